"""Saves too big for a small shared-memory filesystem, then one that fits; prints a json report.

Argument: a directory on that filesystem. Each save that fails is reported by its error's type
and message; a process killed by SIGBUS (a mapping past the filesystem's space) reports nothing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from aegis.checkpoint import api
from aegis.checkpoint.dcp import Writer


def main() -> None:
    base = Path(sys.argv[1])
    saver = api.Saver(api.SaverSettings(base / "pod", None))
    report: dict[str, object] = {}
    try:
        saver.save(1, {"w": torch.ones(1 << 20)})  # 4 MiB
    except api.ShmFullError as exc:
        report["saver"] = str(exc)
    report["left"] = sorted(os.listdir(base / "pod"))
    saver.save(1, {"w": torch.ones(1 << 16)})  # 256 KiB: fits
    report["after"] = sorted(os.listdir(base / "pod"))
    env = {"AEGIS_CKPT_SHM": str(base / "dcp-pod"), "AEGIS_DCP_DIR": str(base / "dcp")}
    try:
        dcp.save({"w": torch.ones(1 << 20)}, storage_writer=Writer(environ=env), checkpoint_id=1)
    except CheckpointException as exc:  # DCP wraps what the writer raised
        report["dcp"] = str(exc)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
