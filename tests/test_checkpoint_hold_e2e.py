"""On the emulated cluster: one pod's checkpoint store fails while its peer goes on committing.
The job stays committed at the step the failing pod last committed, so the pod ahead keeps that
step on disk however many it commits past it (``keep`` is 3): a crash then has both ranks resume
from it. By ``keep`` alone the pod ahead pruned it, and its rank started again from scratch
while its peer resumed (a silent split of the job's timeline). Once the store is back and the
job commits anew, the held step is pruned as any other."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import sys
from pathlib import Path

import pytest

from aegis.checkpoint import layout as lay
from tests.cluster import leftovers, run_cluster
from tests.jsonl import json_lines
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = Path(__file__).parent / "bin" / "hold_probe.py"


def committed_steps(ckpt: Path) -> list[int]:
    return [s for s in lay.disk_steps(ckpt) if (lay.step_dir(ckpt, s) / lay.COMMIT).exists()]


async def test_a_pod_ahead_of_a_failed_store_keeps_the_step_the_job_resumes_from(
    tmp_path: Path,
) -> None:
    control = tmp_path / "control"
    control.mkdir()
    seen: dict[str, object] = {}

    async def outage_then_crash(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        ahead, behind = log_dir / "checkpoints" / "h-0", log_dir / "checkpoints" / "h-1"
        await async_wait_until(lambda: len(committed_steps(behind)) >= 2, 120, "commits")
        away = behind.with_name("h-1.away")
        behind.rename(away)  # h-1's store fails: its path is a file now (ENOTDIR)
        behind.write_text("not a directory\n")
        held = await settled_commit(log_dir, ahead)
        seen["held"], seen["ahead"] = held, committed_steps(ahead)
        (control / "crash").write_text("")  # rank 0 fails: both restart in place
        await async_wait_until(
            lambda: len(json_lines(tmp_path / "out" / "rank-0.jsonl")) == 2, 120, "rank 0 restarted"
        )
        (control / "crash").unlink()
        behind.unlink()
        away.rename(behind)  # the store is back: the job commits anew, the hold moves on
        await async_wait_until(lambda: held not in committed_steps(ahead), 120, "held pruned")
        (control / "finish").write_text("")

    command = [sys.executable, str(PROBE), str(tmp_path / "out"), str(control)]
    flags = ["--nodes", "2", "--spare-nodes", "0", "--job", "h", "--max-retry", "2"]
    run = await run_cluster(tmp_path, flags, command, during=outage_then_crash)
    assert run.rc == 0, run.output
    held = seen["held"]
    assert isinstance(held, int) and held in seen["ahead"], seen  # kept though 4 commits past
    for rank in range(2):
        first, second = run.records(rank)
        assert (first["incarnation"], second["incarnation"]) == (0, 1)
        assert second["resume_step"] == str(held), second
        assert second["resumed_from"] == held and second["found"] == float(held), second
    assert run.status["status"]["phase"] == "Succeed"
    assert leftovers(run.log_dir) == []
    shutil.rmtree(run.log_dir / "checkpoints", ignore_errors=True)


def last_commit(log_dir: Path) -> int:
    """The step of the last ``CheckpointCommitted`` the master logged (-1: none yet)."""
    step = -1
    for line in (log_dir / "events.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # (a line being written)
            record = json.loads(line)
            if record.get("type") == "CheckpointCommitted":
                step = int(record["step"])
    return step


def commits_past(ckpt: Path, step: int) -> bool:
    return len([s for s in committed_steps(ckpt) if s > step]) >= 4


async def settled_commit(log_dir: Path, ahead: Path) -> int:
    """The job's committed step once h-0 has committed four steps past it: the job commits no
    new step while h-1's store is down, so the last one the master logged holds still (read
    again until it does: h-1's last report may still have been on its way)."""
    while True:
        held = last_commit(log_dir)
        await async_wait_until(functools.partial(commits_past, ahead, held), 60,
                               "h-0 four commits past the job's step")  # fmt: skip
        if last_commit(log_dir) == held:
            return held
