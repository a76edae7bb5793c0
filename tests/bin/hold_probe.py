"""A DDP stand-in for the checkpoint-hold test: ``hold_probe.py OUT CONTROL``.

Each incarnation of each rank appends one JSON line to OUT/rank-R.jsonl: its restart count, the
step it resumed from (``aegis.checkpoint.load_latest``), the value it found there, the step the
master had it resume from (``AEGIS_RESUME_STEP``) and its pid. Then it trains (gloo all_reduce
and ``aegis.progress`` every step, ``aegis.checkpoint.save`` every 2 steps, 0.1 s a step) until
CONTROL/finish exists on some rank (all ranks stop at the same step: the flag travels in the
all_reduce). While CONTROL/crash exists, rank 0 of the first incarnation raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import aegis.checkpoint

out, control = Path(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo")
rank, incarnation = dist.get_rank(), int(os.environ.get("AEGIS_RESTART_COUNT", "0"))
restored = aegis.checkpoint.load_latest()
start, found = (restored[0], float(restored[1]["w"][0])) if restored else (0, None)
record = {"rank": rank, "incarnation": incarnation, "resumed_from": start, "found": found,
          "resume_step": os.environ.get("AEGIS_RESUME_STEP"), "pid": os.getpid()}  # fmt: skip
with (out / f"rank-{rank}.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
step = start
while True:
    step += 1
    flag = torch.tensor([1.0 if (control / "finish").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
    aegis.progress(step)  # (it prints nothing and hardly uses a CPU: no step signal otherwise)
    if step % 2 == 0:
        aegis.checkpoint.save(step, {"w": torch.full((1024,), float(step))})
    if rank == 0 and incarnation == 0 and (control / "crash").exists():
        raise RuntimeError(f"injected failure of rank 0 at step {step}")
    time.sleep(0.1)
dist.destroy_process_group()
