"""The committed gRPC code is exactly what protoc generates from proto/aegis.proto."""

from __future__ import annotations

from pathlib import Path

from aegis.adapters.grpc import codegen


def test_generated_grpc_code_has_not_drifted_from_the_proto(tmp_path: Path) -> None:
    fresh = codegen.generate(out_dir=tmp_path)
    assert [p.name for p in fresh] == ["aegis_pb2.py", "aegis_pb2.pyi", "aegis_pb2_grpc.py"]
    for path in fresh:
        committed = codegen.OUT_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{path.name} drifted: regenerate"
