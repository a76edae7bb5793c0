"""One rank (gloo, CPU) that saves DCP steps 1 and 2 or loads the newest valid one.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, AEGIS_CKPT_SHM, AEGIS_DCP_DIR.
Arguments: ``save CKPT_DIR`` (steps 1 and 2, each committed to disk as the saver daemon does,
CKPT_DIR for its own records) or ``load REPORT`` (a json file: the step and source the Reader
chose, and the tensor loaded). Rank r's state is ``{"w<r>": arange(4) * step}``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from aegis.checkpoint import daemon
from aegis.checkpoint.dcp import Reader, Writer


def main() -> None:
    action, where = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, shm = dist.get_rank(), Path(os.environ["AEGIS_CKPT_SHM"])
    key = f"w{rank}"
    if action == "save":
        for step in (1, 2):
            dcp.save({key: torch.arange(4.0) * step}, storage_writer=Writer(), checkpoint_id=step)
            daemon.commit_one(shm, where, step, 0, 3)
            dist.barrier()
    else:
        state = {key: torch.zeros(4)}
        reader = Reader()
        dcp.load(state, storage_reader=reader)
        report = {"step": reader.step, "source": reader.source, "w": state[key].tolist()}
        where.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
