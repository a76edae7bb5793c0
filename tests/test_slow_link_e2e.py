"""A NIC down to 200 kbit/s is named by allreduce_perf, not timed out on (emulated cluster).

Found by hand: node-1's egress throttled to 200 kbit/s (``tc ... tbf``) under a plain DDP script
(a 9-KB model: 18 down to 2 steps/s). The pace watch reported the slowdown, but allreduce_perf
timed out on every pod: its pairs moved 1-MB buffers, 160 s each at that rate. Every node
was blacklisted as the check's timeout says, and the job failed. Now each link's buffers are
sized to what it has shown it moves (``checks.links``), the check ends in its budget and names
node-1, and its pod moves to the spare at the script's own save."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster import PLAIN_DDP, run_with_a_degraded_link

pytestmark = [pytest.mark.slow, pytest.mark.timing, pytest.mark.timeout(600)]


async def test_a_nic_down_to_200_kbit_is_named_and_its_pod_moves_to_the_spare(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(PLAIN_DDP), "--steps", "1200", "--step-time-s", "0.05",
               "--ckpt-every", "20", "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    run = await run_with_a_degraded_link(tmp_path, "kb", "200kbit", command)
    assert "pair buffers down to" in run.output, run.output
