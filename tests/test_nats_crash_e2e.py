"""The run's own NATS server crashes mid-training, on the emulated cluster (SIGKILL, as an OOM
kill would). ``aegis run`` starts it again on the same port and store; the master and the
agents reconnect to the address they have, the job's status is still in its bucket, and the
job succeeds with no fault counted. Before (found by a chaos run), the server stayed dead: the
master named both pods silent, its status writes timed out, and the job's loop crashed 35 s
later with a traceback (exit 1) while the training itself was fine. The script never imports
aegis."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.cluster import leftovers, run_cluster
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

PLAIN_DDP = Path(__file__).parent / "bin" / "plain_ddp.py"


def _nats_server_of(run: int) -> int:
    """The pid of the NATS server that process ``run`` (an ``aegis run``) started."""
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "nats-server" and run in [p.pid for p in proc.parents()]:
            return int(proc.pid)
    raise AssertionError(f"no nats-server under {run}")


async def test_a_crashed_nats_server_starts_again_and_the_job_goes_on(tmp_path: Path) -> None:
    command = [sys.executable, str(PLAIN_DDP), "--steps", "300", "--step-time-s", "0.05",
               "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    killed: list[int] = []

    async def crash(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / "n-1.log"
        stepped = "rank=1 step 20 "
        await async_wait_until(lambda: pod_log.exists() and stepped in pod_log.read_text(),
                               120, "training on node-1")  # fmt: skip
        pid = _nats_server_of(proc.pid)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "n"]
    run = await run_cluster(tmp_path, flags, command, during=crash, timeout_s=400)
    assert killed, run.output
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert f"(pid {killed[0]}) exited -9: starting it again" in run.output, run.output
    assert "silent for" not in run.output and "Traceback" not in run.output, run.output
    assert {info["node"] for info in run.pods.values()} == {"node-0", "node-1"}
    assert leftovers(run.log_dir) == []


def _last_step(pod_log: Path) -> int:
    """The last training step rank 0 logged (``... rank=0 step N loss ...``)."""
    lines = [line for line in pod_log.read_text().splitlines() if " rank=0 step " in line]
    steps = [int(line.split(" step ")[1].split()[0]) for line in lines]
    return max(steps, default=-1)


async def test_a_hung_nats_server_costs_no_fault_and_the_job_goes_on(tmp_path: Path) -> None:
    """The server is stopped (SIGSTOP: hung, its connections open) for longer than the
    heartbeat timeout while the training goes on. Before, the master named both pods silent
    (counted), and its first flush that timed out left its connection deaf for good (nats-py's
    flush; found by a chaos run). Now the master judges nobody while its bus does not answer,
    and the job succeeds with no fault counted."""
    command = [sys.executable, str(PLAIN_DDP), "--steps", "400", "--step-time-s", "0.05",
               "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    hung: list[int] = []

    async def hang(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / "n-0.log"
        await async_wait_until(lambda: pod_log.exists() and _last_step(pod_log) >= 20, 120,
                               "training on node-0")  # fmt: skip
        pid = _nats_server_of(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        hung.append(pid)
        try:  # the heartbeat timeout (5 s) twice over, as steps trained meanwhile (50 ms each)
            start = _last_step(pod_log)
            await async_wait_until(lambda: _last_step(pod_log) >= start + 200, 120,
                                   "ten seconds of training with the server hung")  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)

    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "n"]
    run = await run_cluster(tmp_path, flags, command, during=hang, timeout_s=400)
    assert hung, run.output
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert "the bus is lost: no pod is judged silent meanwhile" in run.output, run.output
    assert "the bus is back" in run.output and "silent for" not in run.output, run.output
    assert leftovers(run.log_dir) == []
