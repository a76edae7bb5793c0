"""A plain DCP training script for the end-to-end test: ``dcp_resume.py OUT CKPT``.

It knows nothing of Aegis but ``aegis.checkpoint.dcp.Writer`` / ``Reader`` handed to torch's
own ``dcp.save`` / ``dcp.load`` (zero code change otherwise). It resumes with ``dcp.load`` while an
audit hook records every file it opens under CKPT (the durable copies), appends one JSON line
to OUT/rank-R.jsonl (its restart count, the step it resumed from, the value it found, where the
reader took it from, the files it opened), then counts to step 6, saving at every even step;
rank 1 crashes at step 5 in its first incarnation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

out, ckpt = Path(sys.argv[1]), sys.argv[2]
opened: list[str] = []


def audit(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and isinstance(args[0], str | Path) and str(args[0]).startswith(ckpt):
        opened.append(str(args[0]))


sys.addaudithook(audit)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from aegis.checkpoint.dcp import Reader, Writer  # noqa: E402

rank, incarnation = os.environ["RANK"], int(os.environ.get("AEGIS_RESTART_COUNT", "0"))
dist.init_process_group("gloo")
state = {"w": torch.zeros(4096), "step": torch.tensor(0)}
reader = Reader()
with contextlib.suppress(dcp.api.CheckpointException):  # nothing saved yet
    dcp.load(state, storage_reader=reader)
start = int(state["step"])
record = {"incarnation": incarnation, "resumed_from": start, "found": float(state["w"][0]),
          "source": reader.source, "opened": list(opened)}  # fmt: skip
with (out / f"rank-{rank}.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
for step in range(start + 1, 7):
    state["w"].fill_(float(step))
    state["step"].fill_(step)
    if step % 2 == 0:
        dcp.save(state, storage_writer=Writer())
    if step == 5 and rank == "1" and incarnation == 0:
        sys.exit(3)
dist.destroy_process_group()
