"""Regenerate the gRPC code from ``proto/aegis.proto`` (``python -m aegis.adapters.grpc.codegen``).

The generated modules are committed; a test regenerates them into a temporary directory and
fails on any drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[4] / "proto"
OUT_DIR = Path(__file__).resolve().parent / "_generated"


def generate(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto_dir}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto_dir / "aegis.proto"),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    grpc_module = out_dir / "aegis_pb2_grpc.py"
    # protoc emits a top-level import; make it package-relative so the package is importable.
    text = grpc_module.read_text().replace("import aegis_pb2 as", "from . import aegis_pb2 as")
    grpc_module.write_text(text)
    return sorted(out_dir.glob("aegis_pb2*"))


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
