"""The supervisor's group kill: what a group's signal misses (workers in sessions of their own,
as torchrun starts them) goes with the group past its grace period."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import psutil

from aegis.agent import group

LEADER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a torchrun slow to stop its workers
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True)
print(worker.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def test_a_worker_in_a_session_of_its_own_is_killed_with_its_group() -> None:
    leader = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LEADER, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert leader.stdout is not None
    worker = int(await asyncio.wait_for(leader.stdout.readline(), 60))
    try:
        assert os.getpgid(worker) != leader.pid  # out of reach of the group's signal
        await group.terminate_group(leader.pid, grace_s=0.5)
        assert await asyncio.wait_for(leader.wait(), 30) == -signal.SIGKILL
        assert not _alive(worker)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            leader.kill()
        await leader.wait()
