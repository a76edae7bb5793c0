"""A drain waiting for a plain script's next own save survives the loss of the leader
(emulated cluster, ``--masters 2``, a script that never imports aegis).

Found by reading: the save cadence and the wait lived only in the leader's memory. A new leader
let the awaited save pass, and the pod stayed on the drained node until the drain's deadline,
a full one from the takeover (here: past the job's end). Now the record keeps them
(``master.safe_point_notes``) and the new leader takes that save."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import (
    PLAIN_DDP,
    drain_at_step,
    last_step,
    leftovers,
    master_pid,
    run_cluster,
)
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(600)]

WAITS = "leaves at the script's next own save"  # the leader's line when the wait begins


def _events(log_dir: Path, job: str) -> list[dict[str, Any]]:
    path = log_dir / "default" / job / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_a_drain_waiting_for_the_scripts_save_goes_on_under_the_new_leader(
    tmp_path: Path,
) -> None:
    """Saves every 200 steps of 0.1 s. node-1 is drained after the second; the script declines
    the request, the leader waits for the save at step 600 and is SIGKILLed before it. The
    standby leads, takes that save, and the pod moves to the spare: nothing forced, nothing
    counted."""
    command = [sys.executable, str(PLAIN_DDP), "--steps", "800", "--step-time-s", "0.1",
               "--ckpt-every", "200", "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    killed: list[int] = []
    drained: list[str] = []

    async def drain_then_kill(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / "dt-1.log"
        drained.append(await drain_at_step(log_dir, "dt", 410, 300))  # after two own saves

        def waiting() -> int | None:
            for i in range(2):
                if WAITS in (log_dir / f"master-{i}.log").read_text():
                    return i + 1
            return None

        found = await async_wait_until(waiting, 120, "the drain waiting")
        assert isinstance(found, int)
        leader = found - 1
        waited_at = last_step(pod_log, 1)
        # the wait is stored with the leader's next write, at once: 20 steps (2 s) later it is
        await async_wait_until(lambda: last_step(pod_log, 1) >= waited_at + 20, 60, "20 steps")
        assert last_step(pod_log, 1) < 580, "too late: the save at 600 would come first"
        os.kill(master_pid(log_dir, leader), signal.SIGKILL)
        killed.append(leader)

    flags = ["--nodes", "3", "--spare-nodes", "1", "--job", "dt", "--max-retry", "2",
             "--masters", "2"]  # fmt: skip
    run = await run_cluster(tmp_path, flags, command, during=drain_then_kill, timeout_s=560)
    assert drained and drained[0].startswith("0: "), drained
    assert killed, run.output
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert status["error_nodes"] == [] and run.pods["dt-1"]["node"] == "spare-0", status
    standby = (run.log_dir / f"master-{1 - killed[0]}.log").read_text()
    assert "leads job default.dt" in standby and "script saved at step 600" in standby, standby
    events = _events(run.log_dir, "dt")
    assert not any(e["type"] == "DrainForced" for e in events), events
    assert [e["step"] for e in events if e["type"] == "CheckpointCommitted"] == [600], events
    assert leftovers(run.log_dir) == []
