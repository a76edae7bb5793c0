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
from pathlib import Path

import psutil
import pytest

from tests.cluster import ClusterRun, Scenario, last_step, leftovers, plain_ddp, run_cluster
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _nats_server_of(run: int) -> int:
    """The pid of the NATS server that process ``run`` (an ``aegis run``) started."""
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "nats-server" and run in [p.pid for p in proc.parents()]:
            return int(proc.pid)
    raise AssertionError(f"no nats-server under {run}")


async def _signal_once_training(
    proc: asyncio.subprocess.Process, log_dir: Path, sig: signal.Signals
) -> tuple[int, Path]:
    """Once rank 0 has trained 20 steps, ``sig`` to the run's NATS server: its pid, and rank 0's
    pod log."""
    pod_log = log_dir / "pods" / "n-0.log"
    await async_wait_until(lambda: last_step(pod_log, 0) >= 20, 120, "training on node-0")
    pid = _nats_server_of(proc.pid)
    os.kill(pid, sig)
    return pid, pod_log


async def _run_without_a_fault(
    tmp_path: Path, steps: int, during: Scenario, masters: int = 1
) -> ClusterRun:
    """The plain script on two nodes and a spare, to its end: it succeeds with no fault counted
    and leaves nothing behind."""
    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "n", "--masters", str(masters)]
    command = plain_ddp(tmp_path / "ckpt", steps)
    run = await run_cluster(tmp_path, flags, command, during=during, timeout_s=400)
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert leftovers(run.log_dir) == []
    return run


@pytest.mark.parametrize("masters", [1, 3])
async def test_a_crashed_nats_server_starts_again_and_the_job_goes_on(
    tmp_path: Path, masters: int
) -> None:
    """With one master (in ``aegis run``'s process) and with three (processes of their own,
    one leading, through the same server)."""
    killed: list[int] = []

    async def crash(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        killed.append((await _signal_once_training(proc, log_dir, signal.SIGKILL))[0])

    run = await _run_without_a_fault(tmp_path, 300, crash, masters)
    assert killed, run.output
    assert f"(pid {killed[0]}) exited -9: starting it again" in run.output, run.output
    assert "silent for" not in run.output and "Traceback" not in run.output, run.output
    assert {info["node"] for info in run.pods.values()} == {"node-0", "node-1"}


async def test_a_hung_nats_server_costs_no_fault_and_the_job_goes_on(tmp_path: Path) -> None:
    """The server is stopped (SIGSTOP: hung, its connections open) for longer than the
    heartbeat timeout while the training goes on. Before, the master named both pods silent
    (counted), and its first flush that timed out left its connection deaf for good (nats-py's
    flush; found by a chaos run). Now the master judges nobody while its bus does not answer,
    and the job succeeds with no fault counted."""
    hung: list[int] = []

    async def hang(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pid, pod_log = await _signal_once_training(proc, log_dir, signal.SIGSTOP)
        hung.append(pid)
        try:  # the heartbeat timeout (5 s) twice over, as steps trained meanwhile (50 ms each)
            start = last_step(pod_log, 0)
            await async_wait_until(lambda: last_step(pod_log, 0) >= start + 200, 120,
                                   "ten seconds of training with the server hung")  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)

    run = await _run_without_a_fault(tmp_path, 400, hang)
    assert hung, run.output
    assert "the bus is lost: no pod is judged silent meanwhile" in run.output, run.output
    assert "the bus is back" in run.output and "silent for" not in run.output, run.output
