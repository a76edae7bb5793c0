"""Real gloo ranks for the DCP tests: one process per rank, each on its own shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aegis.spawn.ports import free_port

RANK_TIMEOUT_S = 300.0  # a rank left in a collective another skipped would wait for ever


def run_ranks(
    script: Path, argv: list[str], shms: list[Path], dcp_root: Path, logs: Path, name: str
) -> str:
    """Run ``script ARGV`` (``{rank}`` filled in) as gloo rank r on shared memory ``shms[r]``,
    saving DCP checkpoints under ``dcp_root``; each rank's output in ``logs/<name>-rank<r>.log``.
    Their output, once every rank exited 0 (asserted); a rank still running after
    ``RANK_TIMEOUT_S`` is killed."""
    port = free_port()
    procs = []
    for rank, shm in enumerate(shms):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(shms)),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "AEGIS_CKPT_SHM": str(shm), "AEGIS_DCP_DIR": str(dcp_root)}  # fmt: skip
        with (logs / f"{name}-rank{rank}.log").open("wb") as log:
            command = [sys.executable, str(script), *(a.format(rank=rank) for a in argv)]
            procs.append(subprocess.Popen(command, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=logs))  # fmt: skip
    try:
        codes = [p.wait(timeout=RANK_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "".join((logs / f"{name}-rank{r}.log").read_text() for r in range(len(shms)))
    assert codes == [0] * len(shms), f"{name}: ranks exited {codes}:\n{text[-6000:]}"
    return text
