"""A rank that prepares the data before training while the others wait at a barrier is no hang
(on the emulated cluster, a script that never imports aegis).

Before its first step a job has no step signal: a watchdog judges by output and CPU alone, and
a rank waiting in ``dist.barrier()`` prints nothing and uses no CPU. Its watchdog reports a
hang after 60 s. The master then sees that every report was judged with no step signal and that
rank 0 did not report (it works): the reports wait for it. Once rank 0 is done, the waiting
ranks' heartbeats say their training moved on, and the reports are withdrawn. Before, the hang
was judged at once, rank 0 blamed and restarted, and the job failed when its budget ran out.
Then the leading master is SIGKILLed: the new leader hears no report again (an agent whose hang
is over resends it no more), and judges nothing.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import pytest

from tests.cluster import master_pid, plain_ddp, run_cluster
from tests.jsonl import json_lines
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HELD = "still at work"
WITHDRAWN = "its hang report is withdrawn"


def _leader(log_dir: Path) -> int:
    """The master that took the job last (the highest epoch; -1: none yet)."""
    epochs = [(int(found[1]), int(found[0])) for found in
              re.findall(r"master-(\d+) INFO .*leads job default\.prep \(epoch (\d+)\)",
                         "\n".join(_masters_said(log_dir, "leads job")))]  # fmt: skip
    return max(epochs)[1] if epochs else -1


def _masters_said(log_dir: Path, what: str) -> list[str]:
    return [line for path in sorted(log_dir.glob("master-*.log"))
            for line in path.read_text(errors="replace").splitlines() if what in line]  # fmt: skip


async def test_rank_0_preparing_while_the_others_wait_at_a_barrier_is_no_hang(
    tmp_path: Path,
) -> None:
    prepared = tmp_path / "prepared"

    async def scenario(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        del proc
        await async_wait_until(lambda: _masters_said(log_dir, HELD), 400,
                               "the hang reports held for rank 0")  # fmt: skip
        prepared.write_text("")
        await async_wait_until(lambda: len(_masters_said(log_dir, WITHDRAWN)) == 2, 120,
                               "both reports withdrawn")  # fmt: skip
        leader = _leader(log_dir)
        os.kill(master_pid(log_dir, leader), signal.SIGKILL)
        await async_wait_until(lambda: _leader(log_dir) != leader, 120, "a new leader")

    command = [*plain_ddp(tmp_path / "ckpt", steps=400), "--prepare-until", str(prepared)]
    run = await run_cluster(tmp_path, ["--nodes", "3", "--spare-nodes", "0", "--job", "prep",
                                       "--masters", "2"], command, during=scenario,
                            timeout_s=540)  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert (status["phase"], status["recover_count"]) == ("Succeed", 0)
    events = json_lines(run.log_dir / "default" / "prep" / "events.jsonl")  # (two masters)
    assert [e["type"] for e in events].count("JobCreated") == 1
    assert [e for e in events if e["type"] in ("HangJudged", "HangReported")] == []
    [held] = _masters_said(run.log_dir, HELD)
    assert "wait for prep-0" in held, held
    withdrawn = _masters_said(run.log_dir, WITHDRAWN)
    assert sorted(line.split("pod ")[1].split(":")[0] for line in withdrawn) == ["prep-1", "prep-2"]
