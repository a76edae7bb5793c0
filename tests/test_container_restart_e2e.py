"""On the emulated cluster: a pod's agent is SIGKILLed (nothing of it cleans up), the platform
kills what it left at once (as a container's processes end with its PID 1), and the master puts
the pod on the same node again. The node's private ``/dev/shm`` still holds the old training's
saves, stamped with its incarnation. The new agent's training goes on counting after them
(counted from 0 again, a commit of the old timeline persisted after the round that rewound the
job was reported as the new one's, where the old agent had restarted its training in place:
``tests/test_agent_link_commits.py``), and resumes from the job's committed step with its peer."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from aegis.checkpoint import layout as lay
from aegis.platforms.local import session_members
from tests.cluster import agent_of, leftovers, run_cluster
from tests.jsonl import json_lines
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROBE = Path(__file__).parent / "bin" / "hold_probe.py"


def heartbeats_lost(log_dir: Path) -> list[str]:
    """The lost heartbeats the master has seen so far (its event log, flushed per line)."""
    path = log_dir / "events.jsonl"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [line for line in text.splitlines() if '"HeartbeatLost"' in line]


async def test_a_pod_whose_agent_died_counts_on_from_its_predecessors_saves(
    tmp_path: Path,
) -> None:
    control, out = tmp_path / "control", tmp_path / "out"
    control.mkdir()
    seen: dict[str, int] = {}

    async def kill_the_agent(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        ckpt = log_dir / "checkpoints" / "c-1"
        await async_wait_until(lambda: len(lay.disk_steps(ckpt)) >= 2, 120, "c-1's commits")
        pid = await async_wait_until(lambda: agent_of(log_dir, "c-1"), 30, "c-1's agent")
        assert isinstance(pid, int)
        seen["killed"] = pid
        os.kill(pid, signal.SIGKILL)
        # the pod ends with its agent, before the master has missed its heartbeats (5 s) and
        # replaced it (before the fix its training went on committing until then)
        await async_wait_until(lambda: not session_members(pid), 30, "c-1's leftovers gone")
        seen["heartbeats lost before its leftovers were gone"] = len(heartbeats_lost(log_dir))
        await async_wait_until(
            lambda: len(json_lines(out / "rank-1.jsonl")) == 2, 120, "rank 1 started again"
        )
        (control / "finish").write_text("")

    command = [sys.executable, str(PROBE), str(out), str(control)]
    flags = ["--nodes", "2", "--spare-nodes", "0", "--job", "c", "--max-retry", "2",
             "--heartbeat-timeout-s", "5"]  # fmt: skip
    run = await run_cluster(tmp_path, flags, command, during=kill_the_agent)
    assert run.rc == 0, run.output
    assert "killed" in seen
    assert seen["heartbeats lost before its leftovers were gone"] == 0
    assert "c-1's agent exited -9: the " in run.output, run.output
    # rank 0 restarted in place (1); rank 1's new agent counts on after the saves its
    # predecessor left (0), and the restart order makes it 2 (counted from 0 again: 1)
    assert [r["incarnation"] for r in run.records(0)] == [0, 1]
    assert [r["incarnation"] for r in run.records(1)] == [0, 2]
    for rank in range(2):
        second = run.records(rank)[1]
        assert second["resume_step"] is not None, second
        assert second["resumed_from"] == int(second["resume_step"]), second
        assert second["found"] == float(second["resumed_from"]), second
    assert run.records(0)[1]["resume_step"] == run.records(1)[1]["resume_step"]
    pod_log = (run.log_dir / "pods" / "c-1.log").read_text()
    assert "from this pod's previous agent: the training's restart count goes on from 1" in pod_log
    placements = [e for e in run.events() if e.get("type") == "PodRestarted"]
    assert [(e["pod"], e["node"]) for e in placements] == [("c-1", "node-1")], placements
    assert run.status["status"]["phase"] == "Succeed"
    assert leftovers(run.log_dir) == []
