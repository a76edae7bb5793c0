"""What a CRC32 sidecar per DCP file costs, side by side in one run (why only ``.metadata``
has one).

Usage: python benchmarks/dcp_crc.py [--size-mb 256] [--rounds 5] [--dir /tmp/aegis-crc-bench]

- persist: one ``commit_one`` of a DCP step of ``--size-mb`` (fsync'd, as in production) against
  ``zlib.crc32`` over the same number of bytes in memory: what a whole-file CRC32 of the data
  files would add to every persist (their items' own zip CRCs are computed and checked already).
- load from disk (a new node): ``dcp.load`` with ``aegis.checkpoint.dcp.Reader`` of a step with
  its sidecar against the same step without it (as checkpoints written before are read),
  alternated, page cache warm (both read the same files).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from aegis.checkpoint import daemon
from aegis.checkpoint.dcp import Reader, Writer, slot


def _state(size_mb: int, step: int) -> dict[str, object]:
    n = size_mb * (1 << 20) // 4 // 8
    return {f"w{i}": torch.full((n,), float(step + i)) for i in range(8)} | {"step": step}


def _load_s(root: Path, step: int, template: dict[str, object]) -> float:
    env = {"AEGIS_CKPT_SHM": str(root / "no-shm"), "AEGIS_DCP_DIR": str(root / "dcp")}
    started = time.perf_counter()
    dcp_load(template, storage_reader=Reader(environ=env), checkpoint_id=step)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/aegis-crc-bench"))
    args = parser.parse_args()
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    env = {"AEGIS_CKPT_SHM": str(root / "shm"), "AEGIS_DCP_DIR": str(root / "dcp")}
    persist_s: list[float] = []
    for step in (1, 2, 3):
        dcp_save(_state(args.size_mb, step), storage_writer=Writer(environ=env), checkpoint_id=step)
        started = time.perf_counter()
        daemon.commit_one(root / "shm", root / "ckpt", step, 0, 3)
        persist_s.append(time.perf_counter() - started)
    data = os.urandom(1 << 20) * args.size_mb
    started = time.perf_counter()
    zlib.crc32(data)
    crc_s = time.perf_counter() - started
    with_crc = root / "with"
    without = root / "without"
    for target in (with_crc, without):
        shutil.copytree(root / "dcp", target / "dcp")
    for sidecar in (without / "dcp").rglob(f"*{slot.CRC_SUFFIX}"):
        sidecar.unlink()
    template = _state(args.size_mb, 0)
    loads: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(args.rounds):
        loads["with"].append(_load_s(with_crc, 3, template))
        loads["without"].append(_load_s(without, 3, template))
    persist = statistics.median(persist_s[1:])
    w, wo = statistics.median(loads["with"]), statistics.median(loads["without"])
    print(
        f"# {datetime.date.today()} {platform.node()} {os.cpu_count()} CPUs, "
        f"python {sys.version.split()[0]}, torch {torch.__version__}, {args.size_mb} MB"
    )
    print(f"persist (commit_one, fsync'd): median {persist:.3f} s of {persist_s}")
    print(f"crc32 of the same bytes:       {crc_s:.3f} s = {crc_s / persist:.1%} of the persist")
    print(f"load from disk, sidecars:      median {w:.3f} s")
    print(f"load from disk, no sidecars:   median {wo:.3f} s  ratio with/without {w / wo:.2f}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
