"""A DDP stand-in for the disk-full end-to-end test: ``disk_full_train.py CONTROL``.

Counts steps in lockstep with its peers (a gloo ``all_reduce`` every step, as a DDP job's
gradients are), reporting each (``aegis.progress``) and appending it to CONTROL/rank-R.steps;
saves ``{"w": full(16384, step)}`` with ``aegis.checkpoint.save`` every 5th step (policy
``wait``: a save that blocked would stop the counting). Once CONTROL/finish exists on some rank
(the flag travels in the ``all_reduce``, so every rank sees it at the same step) it does 10 more
steps and exits 0.

Lockstep matters: ranks that count on their own drift apart by however much later one of them
started (1.1 s, 55 steps, 11 saves, on a loaded CI machine). The job is committed only at a
step every pod committed, so the pod behind commits a step the pod ahead has only 11 saves
later, and until then the pod ahead holds every step the job may still resume from
(``layout.held``): that filled the test's small disk a second time.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import aegis
import aegis.checkpoint

control = Path(sys.argv[1])
dist.init_process_group("gloo")
steps = control / f"rank-{os.environ['RANK']}.steps"
last: int | None = None
step = 0
while last is None or step < last:
    step += 1
    flag = torch.tensor([1.0 if (control / "finish").exists() else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if last is None and flag.item() > 0:
        last = step + 10
    aegis.progress(step)
    if step % 5 == 0:
        aegis.checkpoint.save(step, {"w": torch.full((16384,), float(step))})
    with steps.open("a") as out:
        out.write(f"{step}\n")
    time.sleep(0.02)
dist.destroy_process_group()
