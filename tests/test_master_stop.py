"""``aegis master`` told to stop while its NATS server is gone: it stops, and says nothing alarming.

A master stopped (SIGTERM) after its server died exited 1 with a ``ConnectionResetError``
traceback (closing a connection already lost), and once, behind ``aegis run --masters 2``
killed by SIGTERM, never exited at all: a NATS client reconnecting to the dead server ignored
its cancellation, and the process waited for it for ever."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.adapters.nats_server import EmbeddedNats
from aegis.cli import master_cmd
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(180)


def test_a_master_stopped_while_its_nats_server_is_gone_exits_0_without_a_traceback(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats()
    server.start()
    out = tmp_path / "master.log"
    argv = [sys.executable, "-m", "aegis", "master", "--insecure", "--nats", server.url,
            "--replica-id", "m0", "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    with out.open("wb") as log:
        master = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_until(lambda: "m0 is leader" in out.read_text(), 120.0, "the master to lead")
        finally:
            server.stop()
        wait_until(lambda: "nats m0: " in out.read_text(), 60.0, "the master to lose its server")
        master.send_signal(signal.SIGTERM)
        assert master.wait(timeout=120) == 0, out.read_text()[-3000:]
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    assert "Traceback" not in out.read_text(), out.read_text()[-3000:]


def test_what_ignores_its_cancellation_at_the_stop_is_named_and_not_waited_for() -> None:
    """The bounded end of a stopped master (``master_cmd.leave_within``): the tasks still there
    are cancelled; one that ends goes, one that does not is named after the bound."""

    async def main() -> tuple[list[str], bool]:
        release = asyncio.Event()
        started = [asyncio.Event(), asyncio.Event()]

        async def stubborn() -> None:
            started[0].set()
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue  # as nats-py's reconnecting loop did

        async def polite() -> None:
            started[1].set()
            await asyncio.Event().wait()

        tasks = [asyncio.create_task(stubborn(), name="stubborn"),
                 asyncio.create_task(polite(), name="polite")]  # fmt: skip
        for event in started:
            await event.wait()
        left = await master_cmd.leave_within(1.0)
        polite_gone = tasks[1].cancelled()
        release.set()
        await tasks[0]
        return left, polite_gone

    assert asyncio.run(main()) == (["stubborn"], True)
