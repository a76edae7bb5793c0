"""A training stand-in for the disk-full end-to-end test: ``disk_full_train.py CONTROL``.

Counts steps, reporting each (``aegis.progress``) and appending it to CONTROL/rank-R.steps;
saves ``{"w": full(16384, step)}`` with ``aegis.checkpoint.save`` every 5th step (policy
``wait``: a save that blocked would stop the counting). Once CONTROL/finish exists it does
10 more steps and exits 0.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import aegis
import aegis.checkpoint

control = Path(sys.argv[1])
rank = os.environ["RANK"]
steps = control / f"rank-{rank}.steps"
last: int | None = None
step = 0
while last is None or step < last:
    step += 1
    aegis.progress(step)
    if step % 5 == 0:
        aegis.checkpoint.save(step, {"w": torch.full((16384,), float(step))})
    with steps.open("a") as out:
        out.write(f"{step}\n")
    if last is None and (control / "finish").exists():
        last = step + 10
    time.sleep(0.02)
