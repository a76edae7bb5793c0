"""The committed gRPC code is exactly what protoc generates from proto/aegis.proto."""

from __future__ import annotations

import re
from pathlib import Path

from aegis.adapters.grpc import codegen


def test_generated_grpc_code_has_not_drifted_from_the_proto(tmp_path: Path) -> None:
    fresh = codegen.generate(out_dir=tmp_path)
    assert [p.name for p in fresh] == ["aegis_pb2.py", "aegis_pb2.pyi", "aegis_pb2_grpc.py"]
    for path in fresh:
        committed = codegen.OUT_DIR / path.name
        assert committed.read_text() == path.read_text(), f"{path.name} drifted: regenerate"


def _floor(name: str) -> tuple[int, ...]:
    """The lowest version of ``name`` that ``pyproject.toml``'s dependencies allow."""
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    (spec,) = [d for d in project["project"]["dependencies"] if re.match(rf"{name}\b", d)]
    found = re.search(r">=\s*([0-9.]+)", spec)
    assert found, spec
    return tuple(int(part) for part in found.group(1).split("."))


def test_the_installable_versions_of_grpcio_and_protobuf_run_the_generated_code() -> None:
    """An image with the lowest grpcio and protobuf that ``pip install aegis-ft`` accepts must
    import the generated code (it refuses an older runtime: grpcio 1.84.0 did, on a GPU image)."""
    generated = (codegen.OUT_DIR / "aegis_pb2_grpc.py").read_text()
    grpc_needed = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", generated)
    pb = (codegen.OUT_DIR / "aegis_pb2.py").read_text()
    pb_needed = re.search(r"Protobuf Python Version: ([0-9.]+)", pb)
    assert grpc_needed and pb_needed
    assert _floor("grpcio") >= tuple(map(int, grpc_needed.group(1).split(".")))
    assert _floor("protobuf") >= tuple(map(int, pb_needed.group(1).split(".")))


def test_the_generator_is_pinned_to_the_version_that_made_the_committed_code() -> None:
    """The drift test regenerates with whatever grpcio-tools is installed, and the generated code
    names that version: an unpinned generator failed it on CI the day 1.85.4 came out. The pin and
    the committed code move together (bump the pin, then regenerate)."""
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    (spec,) = [
        d
        for d in project["project"]["optional-dependencies"]["dev"]
        if d.startswith("grpcio-tools")
    ]
    generated = (codegen.OUT_DIR / "aegis_pb2_grpc.py").read_text()
    made_by = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", generated)
    assert made_by
    assert spec == f"grpcio-tools=={made_by.group(1)}"
