"""A training stand-in for the checkpoint end-to-end test: ``ckpt_resume.py OUT CKPT``.

Resumes with ``aegis.checkpoint.load_latest()`` while an audit hook records every file it opens
under CKPT (the disk copies), then counts to step 6, saving at every even step (a tensor of
step + 1000 x rank: a rank that got another's copy shows it); rank 1 crashes at step 5 in its
first incarnation, once rank 0 has said its line. Each incarnation appends one JSON line to
OUT/rank-R.jsonl as soon as it has resumed, before its steps (its peer's crash may end it before
step 6: torchrun stops a pod's other ranks when one fails): its restart count, the step it
resumed from, the value it found (less 1000 x rank), the files it opened and the step the master
had it resume from (``AEGIS_RESUME_STEP``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

out, ckpt = Path(sys.argv[1]), sys.argv[2]
opened: list[str] = []


def audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and isinstance(args[0], str | Path) and str(args[0]).startswith(ckpt):
        opened.append(str(args[0]))


sys.addaudithook(audit)

import torch  # noqa: E402

import aegis.checkpoint  # noqa: E402

rank, incarnation = os.environ["RANK"], int(os.environ.get("AEGIS_RESTART_COUNT", "0"))
restored = aegis.checkpoint.load_latest()
mine = 1000.0 * int(rank)
start, found = (restored[0], float(restored[1]["w"][0]) - mine) if restored else (0, None)
record = {
    "incarnation": incarnation,
    "resumed_from": start,
    "found": found,
    "opened": opened,
    "resume_step": os.environ.get("AEGIS_RESUME_STEP"),
}  # what the master said: committed
with (out / f"rank-{rank}.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
for step in range(start + 1, 7):
    if step % 2 == 0:
        aegis.checkpoint.save(step, {"w": torch.full((4096,), step + mine)})
    if step == 5 and rank == "1" and incarnation == 0:
        said = out / "rank-0.jsonl"  # rank 0's first line first: the crash may end rank 0
        while not (said.exists() and said.read_text().endswith("\n")):
            time.sleep(0.01)
        sys.exit(3)
