"""The agent under a master keeps tini's signal duties: SIGINT, SIGHUP, SIGQUIT, SIGUSR1,
SIGUSR2, SIGPWR and the others it forwards reach the training group it runs; SIGTERM stops it
and the whole group (a real agent, a real master and a real nats-server, through ``aegis run``'s
local platform)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from aegis.agent import pid1
from aegis.core import events as ev
from aegis.core.model import PodName
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform, session_members
from tests import agent_waits as waits
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# The training command: no aegis import. A second member of its group (forked with the signals
# ignored, so only the script writes) shows that SIGTERM stops the whole group.
SCRIPT = """
import os, signal, sys

out = sys.argv[1]
SIGNALS = [getattr(signal, name) for name in sys.argv[2].split(",")]
for sig in SIGNALS:
    signal.signal(sig, signal.SIG_IGN)
member = os.fork()
if member == 0:
    while True:
        signal.pause()


def note(signum, frame):
    with open(os.path.join(out, "received"), "a") as received:
        received.write(signal.Signals(signum).name + "\\n")


for sig in SIGNALS:
    signal.signal(sig, note)
with open(os.path.join(out, "ready.tmp"), "w") as ready:
    ready.write(f"{os.getpid()} {member}")
os.replace(os.path.join(out, "ready.tmp"), os.path.join(out, "ready"))
while True:
    signal.pause()
"""

SENT = (signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT, signal.SIGUSR2,
        signal.SIGPWR, signal.SIGALRM)  # fmt: skip
POD = PodName("sig-0")


def _received(out: Path) -> list[str]:
    try:
        return (out / "received").read_text().splitlines()
    except FileNotFoundError:
        return []


async def _signals_then_sigterm(platform: LocalPlatform, out: Path) -> None:
    ready = out / "ready"
    await async_wait_until(ready.exists, 120, "the training script to start")
    script, member = (int(pid) for pid in ready.read_text().split())
    proc = platform.pods[POD].process
    assert proc is not None and proc.returncode is None
    for count, sig in enumerate(SENT, 1):
        proc.send_signal(sig)
        expected = [s.name for s in SENT[:count]]
        await async_wait_until(lambda e=expected: _received(out) == e, 30, sig.name)
    assert proc.returncode is None  # none of them stopped the agent
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 60) == 128 + signal.SIGTERM
    assert session_members(proc.pid) == []  # the agent and everything it started
    assert waits.really_gone(script) and waits.really_gone(member)
    assert _received(out) == [s.name for s in SENT]  # SIGTERM was not one of the noted


async def test_linked_agent_forwards_signals_to_its_group_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    assert set(SENT) <= set(pid1.FORWARDED_SIGNALS)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    names = ",".join(sig.name for sig in SENT)
    settings = local_run.RunSettings(
        command=(sys.executable, str(script), str(out), names),
        nodes=1, spare_nodes=0, max_retry=0, job="sig", grace_s=2.0,
        log_dir=tmp_path / "logs", prewarm="0",
    )  # fmt: skip
    seen: dict[str, Any] = {}

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        seen["runner"], seen["platform"] = runner, platform

    job = asyncio.create_task(local_run.run_local(settings, observe=observe))
    try:
        await async_wait_until(lambda: "runner" in seen or job.done(), 60, "the job")
        assert not job.done(), job.result()
        try:
            await _signals_then_sigterm(seen["platform"], out)
        finally:  # the job ends in any case (its replacement agent, if any, is stopped)
            seen["runner"].platform_event(ev.QuitRequested("test done"))
        await asyncio.wait_for(job, 120)
    finally:
        if not job.done():
            job.cancel()
