"""A trivial training stand-in for the Slurm tests: ``slurm_task.py DIR [--crash-once] [--wait]``.

Records its rank, node and environment in DIR; with ``--crash-once`` rank 0 exits 3 the first
time (a marker file in DIR remembers it), so the job needs exactly one in-place restart; with
``--wait`` it finishes only once DIR/go exists (the test's "training is done" switch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
rank = os.environ.get("RANK", "?")
record = {
    k: os.environ.get(k, "")
    for k in (
        "RANK",
        "WORLD_SIZE",
        "AEGIS_NODE",
        "AEGIS_POD",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_JOB_ID",
    )
}
with (out / f"rank-{rank}.jsonl").open("a") as f:
    f.write(json.dumps(record) + "\n")
marker = out / "crashed"
if "--crash-once" in sys.argv and rank == "0" and not marker.exists():
    marker.write_text("1")
    print("slurm_task: rank 0 crashing on purpose", flush=True)
    sys.exit(3)
while "--wait" in sys.argv and not (out / "go").exists():
    time.sleep(0.1)
print(f"slurm_task: rank {rank} done", flush=True)
