"""A NIC down to 200 kbit/s is named by allreduce_perf, not timed out on (emulated cluster).

Found by hand: node-1's egress throttled to 200 kbit/s (``tc ... tbf``) under a plain DDP script
(a 9-KB model: 18 down to 2 steps/s). The pace watch reported the slowdown, but allreduce_perf
timed out on every pod: its pairs moved 1-MB buffers, 160 s each at that rate. Every node
was blacklisted as the check's timeout says, and the job failed. Now each link's buffers are
sized to what it has shown it moves (``checks.links``), the check ends in its budget and names
node-1, and its pod moves to the spare at the script's own save."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.cluster import PLAIN_DDP, last_step, leftovers, run_cluster, throttle
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(600)]


async def test_a_nic_down_to_200_kbit_is_named_and_its_pod_moves_to_the_spare(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(PLAIN_DDP), "--steps", "1200", "--step-time-s", "0.05",
               "--ckpt-every", "20", "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    throttled: list[str] = []

    async def degrade(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / "kb-1.log"
        await async_wait_until(lambda: last_step(pod_log, 1) >= 150, 200, "node-1 training")
        await throttle(log_dir, "node-1", "200kbit")
        throttled.append("node-1")

    flags = ["--nodes", "3", "--spare-nodes", "1", "--job", "kb", "--max-retry", "2",
             "--pace-window-s", "5", "--pace-drop", "0.5"]  # fmt: skip
    run = await run_cluster(tmp_path, flags, command, during=degrade, timeout_s=560)
    assert throttled == ["node-1"]
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert run.pods["kb-1"]["node"] == "spare-0", status
    kinds = ("SlowdownReported", "CheckpointCommitted", "PodRestarted")
    said = [(e["type"], e.get("pod")) for e in run.events() if e["type"] in kinds]
    assert said[:3] == [("SlowdownReported", None), ("CheckpointCommitted", None),
                        ("PodRestarted", "kb-1")], said  # fmt: skip
    assert "pair buffers down to" in run.output, run.output
    assert leftovers(run.log_dir) == []
