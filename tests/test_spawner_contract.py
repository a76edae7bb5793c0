"""One contract for every Spawner (:mod:`aegis.spawn.spawner`): the agent's reaper and the
LocalSpawner of a process with no reaper start and wait for children alike."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from aegis.spawn import spawner as spawning
from tests import forkserver_harness as harness

any_spawner = harness.any_spawner  # a fixture: each Spawner in turn

SEE = """
import json, os, signal, sys
print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0),
                  "term_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                  "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                  "extra": os.read(3, 100).decode()}), flush=True)
sys.exit(int(sys.argv[1]))
"""


async def test_spawner_hands_over_descriptors_and_reports_the_raw_status_when_child_exits(
    any_spawner: spawning.Spawner,
) -> None:
    out_r, out_w = os.pipe()
    extra_r, extra_w = os.pipe()
    os.write(extra_w, b"hello")
    os.close(extra_w)
    try:
        pid = any_spawner.spawn([sys.executable, "-c", SEE, "3"], dict(os.environ),
                                fds={1: out_w, 3: extra_r})  # fmt: skip
    finally:
        os.close(out_w)
        os.close(extra_r)
    raw = await any_spawner.wait(pid)
    with os.fdopen(out_r) as out:
        seen = json.loads(out.read())
    assert os.waitstatus_to_exitcode(raw) == 3  # the raw wait status, not a return code
    assert seen == {"pid": pid, "pgid": pid, "term_default": True, "blocked": [], "extra": "hello"}
    assert await any_spawner.wait(pid) == raw  # every caller gets it
    any_spawner.forget(pid)


async def test_spawner_reports_the_signal_when_child_is_killed(
    any_spawner: spawning.Spawner,
) -> None:
    pid = any_spawner.spawn([sys.executable, "-c", "import time; time.sleep(600)"], os.environ)
    waiters = [asyncio.ensure_future(any_spawner.wait(pid)) for _ in range(2)]
    os.kill(pid, signal.SIGKILL)
    raws = await asyncio.gather(*waiters)
    assert [os.WIFSIGNALED(r) and os.WTERMSIG(r) for r in raws] == [signal.SIGKILL] * 2
    any_spawner.forget(pid)


async def test_spawner_raises_oserror_when_command_cannot_be_executed(
    any_spawner: spawning.Spawner,
) -> None:
    with pytest.raises(OSError):
        any_spawner.spawn(["/nonexistent/aegis-no-such-command"], os.environ)
