"""What stops ``aegis run`` at its edges: a signal heard before the run has a job (while its
NATS server starts), and one after the job ended. Both once killed the run half-way: no last
line, and the server's directory with its keys left in /tmp. (Signals while the job trains:
``test_run_e2e.test_aegis_run_stopped_by_a_signal_exits_128_plus_its_number``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from aegis.platforms import emulated, run_settings
from tests.waits import async_wait_until, wait_until


def test_a_signal_waits_for_the_job_ends_it_and_after_its_end_is_only_logged() -> None:
    stop, asked = run_settings.RunStop(), []
    stop.check()  # nothing heard
    stop.heard(signal.SIGTERM)
    with pytest.raises(run_settings.RunStoppedError) as caught:
        stop.check()  # no job yet: the run ends after the step under way
    assert caught.value.signo == signal.SIGTERM
    stop.attach(asked.append)  # a job now: the signal heard ends it at once
    stop.check()
    stop.heard(signal.SIGINT)
    assert asked == ["aegis run got SIGTERM", "aegis run got SIGINT"]
    stop.ended()
    stop.heard(signal.SIGHUP)  # the job ended: it changes nothing
    assert len(asked) == 2 and stop.stopped_by == signal.SIGTERM
    assert stop.got == [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def test_a_signal_after_the_end_is_no_stop() -> None:
    stop = run_settings.RunStop()
    stop.attach(lambda reason: None)
    stop.ended()
    stop.heard(signal.SIGINT)
    assert stop.stopped_by is None and stop.got == [signal.SIGINT]


async def test_the_handlers_hear_a_real_signal_and_give_the_default_back() -> None:
    with run_settings.stop_signals() as stop:
        os.kill(os.getpid(), signal.SIGHUP)  # would end this process without the handler
        await async_wait_until(lambda: stop.got == [signal.SIGHUP], what="the signal heard")
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


@pytest.mark.timing
def test_a_signal_while_the_nats_server_starts_stops_the_run_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """``aegis run`` gets SIGTERM as its NATS server starts: it stops once the server is up,
    no job is made, it says so on one line and exits 143, and the server goes, with its
    directory (the operator's keys), and the run's own (empty) temporary directory. It once
    died at once: no line, both directories left."""
    temp = tmp_path / "tmp"  # where the server's directory and the run's go
    temp.mkdir()
    out = tmp_path / "out.log"
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--nodes", "2", "--spare-nodes", "0",
            "--view", "plain", "--",
            sys.executable, "-c", "import time; time.sleep(300)"]  # fmt: skip
    with out.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(temp)})  # fmt: skip
    try:
        wait_until(lambda: any(temp.glob("aegis-nats-*")), 120.0, "the server starting")
        [server_dir] = temp.glob("aegis-nats-*")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = out.read_text().splitlines()[-1]
    assert last == "aegis run: aegis run got SIGTERM before the job started; nothing of it is left"
    assert list(temp.iterdir()) == []  # no job was made: its log directory is gone too
    servers = (p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"])
    assert [p.pid for p in servers if str(server_dir) in " ".join(p.info["cmdline"])] == []


async def test_a_run_in_the_cluster_namespace_killed_by_a_signal_exits_as_a_shell_says() -> None:
    """A run killed before it could handle the signal (in its first second) gave 241 for
    SIGTERM (-15 as an exit status); a shell says 143."""
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    assert await emulated.run_outside(argv) == 128 + signal.SIGTERM
    assert await emulated.run_outside([sys.executable, "-c", "raise SystemExit(3)"]) == 3
