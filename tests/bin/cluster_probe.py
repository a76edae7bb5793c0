"""A DDP stand-in for the emulated-cluster tests: ``cluster_probe.py OUT CKPT [options]``.

Each incarnation of each rank appends one JSON line to OUT/rank-R.jsonl: where it ran (its
hostname and the address that name resolves to), where it met (MASTER_ADDR:MASTER_PORT), what
its node's /dev/shm held when it started, the step it resumed from and the checkpoint files it
opened under CKPT (an audit hook: none when it restored from its agent's shared memory), and the
torch libraries its agent (the nearest ``aegis agent`` above it) has mapped. Then it
trains (gloo all_reduce every step, ``aegis.checkpoint.save`` every 2 steps) to ``--steps``.
``--fail-rank R --fail-at-step S --fail-how raise|exit`` makes rank R fail at step S in its first
incarnation (raise: a Python exception; exit: ``os._exit(1)`` with no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("ckpt")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--step-time-s", type=float, default=0.1)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--fail-at-step", type=int, default=0)
parser.add_argument("--fail-how", choices=("raise", "exit"), default="raise")
args = parser.parse_args()
opened: list[str] = []


def audit(event: str, audit_args: tuple[object, ...]) -> None:
    target = audit_args[0] if audit_args else None
    if event == "open" and isinstance(target, str | Path) and str(target).startswith(args.ckpt):
        opened.append(str(target))


sys.addaudithook(audit)


def agent_torch() -> list[str] | None:
    """The torch files mapped by the nearest ``aegis agent`` process above this one (None: no
    agent found)."""
    pid = os.getppid()
    for _ in range(6):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"aegis" in argv and b"agent" in argv:
                maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
                return sorted({line.split()[-1] for line in maps if "torch" in line})
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
    return None


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import aegis.checkpoint  # noqa: E402

shm = sorted(os.listdir("/dev/shm"))
dist.init_process_group("gloo")
rank, incarnation = dist.get_rank(), int(os.environ.get("AEGIS_RESTART_COUNT", "0"))
restored = aegis.checkpoint.load_latest()
start = restored[0] if restored else 0
host = socket.gethostname()
record = {
    "rank": rank, "incarnation": incarnation, "hostname": host,
    "address": socket.gethostbyname(host), "pod": os.environ.get("AEGIS_POD"),
    "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", "shm": shm,
    "resumed_from": start, "opened": list(opened), "agent_torch": agent_torch(),
}  # fmt: skip
with (args.out / f"rank-{rank}.jsonl").open("a") as out:
    out.write(json.dumps(record) + "\n")
value = torch.ones(1)
for step in range(start + 1, args.steps + 1):
    dist.all_reduce(value)
    value /= value.item()
    if step % 2 == 0:
        aegis.checkpoint.save(step, {"w": torch.full((1024,), float(step))})
    if rank == args.fail_rank and step == args.fail_at_step and incarnation == 0:
        if args.fail_how == "exit":
            os._exit(1)
        raise RuntimeError(f"injected failure of rank {rank} at step {step}")
    time.sleep(args.step_time_s)
dist.destroy_process_group()
