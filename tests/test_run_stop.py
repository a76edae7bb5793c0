"""What stops ``aegis run`` at its edges: a signal heard before the run has a job (while its
NATS server starts, while its master connects), and one after the job ended. Both once killed
the run half-way: no last line, and the server's directory with its keys left in /tmp.
(Signals while the job trains: ``test_run_e2e``, ``..._exits_128_plus_its_number``.)"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from aegis.adapters.nats_auth import Authority
from aegis.master.service import MasterSettings
from aegis.platforms import emulated, run_settings
from aegis.platforms.master_bootstrap import run_master
from tests.test_agent_cli import unshare_works
from tests.waits import async_wait_until, wait_until


async def test_a_signal_before_the_job_cancels_the_run_once() -> None:
    """A second signal while the cancelled run takes itself down is only logged: cancelling
    it again would cut its clean-up short (a NATS server's directory left)."""

    async def run() -> None:
        await asyncio.Event().wait()

    main = asyncio.create_task(run())
    stop = run_settings.RunStop(main)
    assert stop.stopped_error() is None
    stop.heard(signal.SIGTERM)  # no job yet: the run is cancelled
    stop.heard(signal.SIGINT)  # the second: logged only
    with pytest.raises(asyncio.CancelledError):
        await main
    assert main.cancelling() == 1
    stopped = stop.stopped_error()
    assert stopped is not None and stopped.signo == signal.SIGTERM
    assert stop.got == [signal.SIGTERM, signal.SIGINT]


def test_a_signal_asks_a_job_to_end_until_it_ended() -> None:
    stop, asked = run_settings.RunStop(None), []
    stop.attach(asked.append)  # a job: a signal asks for its end
    stop.heard(signal.SIGINT)
    stop.heard(signal.SIGTERM)
    stop.ended()
    stop.heard(signal.SIGHUP)  # the job ended: it changes nothing
    assert asked == ["aegis run got SIGINT", "aegis run got SIGTERM"]
    assert stop.stopped_by == signal.SIGINT and stop.got == [2, 15, 1]


async def test_a_quit_with_no_job_yet_cancels_the_run_as_a_stop() -> None:
    """A replicated run's quit before its leader serves the job cancels the run through
    ``cancel_run``: the cancellation is a stop (``RunStoppedError``), not a crash."""

    async def run() -> None:
        await asyncio.Event().wait()

    main = asyncio.create_task(run())
    stop = run_settings.RunStop(main)
    stop.attach(lambda reason: stop.cancel_run())
    stop.heard(signal.SIGINT)
    with pytest.raises(asyncio.CancelledError):
        await main
    stopped = stop.stopped_error()
    assert stopped is not None and stopped.signo == signal.SIGINT


async def test_a_run_that_lost_its_cancellation_stops_the_job_it_makes() -> None:
    """The signal's cancellation was swallowed on the way (3.11's ``wait_for`` in a NATS call):
    the run went on and made a job. The job is asked to end as it is attached, not run for
    hours with the user's stop forgotten."""
    main = asyncio.create_task(asyncio.Event().wait())
    stop, asked = run_settings.RunStop(main), []
    stop.heard(signal.SIGTERM)  # no job yet: the run is cancelled (and, here, it is lost)
    stop.attach(asked.append)
    assert asked == ["aegis run got SIGTERM"]
    assert stop.stopped_by == signal.SIGTERM
    with pytest.raises(asyncio.CancelledError):
        await main


async def test_a_replicated_run_that_lost_its_cancellation_ends_the_job_once_served() -> None:
    """A replicated run attaches its quit before it starts; a signal then, with no job served
    yet, cancels the run. Lost on the way (``KvStore.open`` swallowed it), the run served its
    job and ran it to the end, exit 0. Asked again once served, the job ends."""
    main = asyncio.create_task(asyncio.Event().wait())
    stop, asked, served = run_settings.RunStop(main), [], []

    def quit_job(reason: str) -> None:
        if served:
            asked.append(reason)
        else:
            stop.cancel_run()

    stop.attach(quit_job)
    stop.ask_again()  # nothing heard: nothing asked
    stop.heard(signal.SIGTERM)  # no job served: the run is cancelled (and here it is lost)
    served.append("the job")
    stop.ask_again()
    assert asked == ["aegis run got SIGTERM"]
    stop.ended()
    stop.ask_again()  # the job ended: nothing more to ask
    assert asked == ["aegis run got SIGTERM"]
    with pytest.raises(asyncio.CancelledError):
        await main


def test_a_cancellation_not_made_by_a_signal_is_no_stop() -> None:
    stop = run_settings.RunStop(None)
    stop.attach(lambda reason: None)
    stop.heard(signal.SIGTERM)  # the job is asked to end; nothing was cancelled here
    assert stop.stopped_by == signal.SIGTERM and stop.stopped_error() is None


def test_a_signal_after_the_end_is_no_stop() -> None:
    stop = run_settings.RunStop(None)
    stop.attach(lambda reason: None)
    stop.ended()
    stop.heard(signal.SIGINT)
    assert stop.stopped_by is None and stop.stopped_error() is None
    assert stop.got == [signal.SIGINT]


@pytest.mark.parametrize("ended_first", [False, True])
def test_a_second_signal_kills_the_pods_once_whenever_it_comes(ended_first: bool) -> None:
    """The first signal asks the job to end; the second also kills the pods at once (the user
    will not wait out their grace period), and so does a third (a pod that started since). After
    the job ended (its pods flush their last save) the first is only logged, the second kills."""
    now = [0.0]
    stop, asked, killed = run_settings.RunStop(None, clock=lambda: now[0]), [], []
    stop.attach(asked.append)
    stop.on_second(lambda: killed.append(len(stop.got)))
    if ended_first:
        stop.ended()
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        stop.heard(sig)
        assert killed == list(range(2, len(stop.got) + 1))
        now[0] += 1.0
    wanted = ["aegis run got SIGINT"] * 2 + ["aegis run got SIGTERM"]
    assert asked == ([] if ended_first else wanted)


def test_the_same_signal_again_at_once_is_the_same_stop() -> None:
    """GNU ``timeout`` signals its command, then its process group: the run hears SIGTERM twice
    in a row. That is one stop (the pods keep their grace period); the same signal a second
    later, or another signal at once, is a second."""
    now = [0.0]
    stop, asked, killed = run_settings.RunStop(None, clock=lambda: now[0]), [], []
    stop.attach(asked.append)
    stop.on_second(lambda: killed.append(len(stop.got)))
    stop.heard(signal.SIGTERM)
    now[0] += run_settings.ECHO_S / 10
    stop.heard(signal.SIGTERM)  # the echo
    assert killed == [] and asked == ["aegis run got SIGTERM"]
    now[0] += run_settings.ECHO_S
    stop.heard(signal.SIGTERM)
    assert killed == [3]
    stop.heard(signal.SIGINT)  # another signal, at once: not an echo
    assert killed == [3, 4] and stop.got == [15, 15, 15, 2]


async def test_the_handlers_hear_a_real_signal_and_give_the_default_back() -> None:
    asked: list[str] = []
    with run_settings.stop_signals() as stop:
        stop.attach(asked.append)  # a job: the signal asks for its end
        os.kill(os.getpid(), signal.SIGHUP)  # would end this process without the handler
        await async_wait_until(lambda: asked == ["aegis run got SIGHUP"], what="the signal")
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


@pytest.mark.timing
def test_a_signal_before_the_job_stops_the_run_in_one_line_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """``aegis run --nats`` to a server that never answers: the master's connect waits (nats-py
    retries for ever), and no job can be made. SIGTERM ends the run at once, in one line and
    exit 143, with its temporary log directory gone. (It was deaf to it: the new handlers only
    noted a signal before the job, and the connect never ended.)"""
    temp = tmp_path / "tmp"  # where the run's own directory goes
    temp.mkdir()
    out = tmp_path / "out.log"
    with socket.socket() as silent:  # accepts connections, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        argv = [sys.executable, "-m", "aegis.cli.main", "run", "--nodes", "2",
                "--spare-nodes", "0", "--view", "plain",
                "--nats", f"nats://127.0.0.1:{silent.getsockname()[1]}", "--",
                sys.executable, "-c", "import time; time.sleep(300)"]  # fmt: skip
        with out.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "TMPDIR": str(temp)})  # fmt: skip
        try:
            wait_until(lambda: any(temp.glob("aegis-run-*")), 120.0, "the run started")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 128 + signal.SIGTERM, out.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    last = out.read_text().splitlines()[-1]
    assert last == "aegis run: aegis run got SIGTERM before the job started; nothing of it is left"
    assert list(temp.iterdir()) == []


async def test_a_master_cancelled_while_its_nats_server_starts_leaves_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled at whatever point of its start (the server's launch in a thread, the
    connect): the server is stopped and its directory, with the operator's keys, removed. (The
    launch went on in its thread after the clean-up: a server left running, its directory
    left in /tmp.)"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the server's directory goes

    async def start() -> None:
        async with run_master(MasterSettings(), nats_url=None, authority=Authority(),
                              server_host="127.0.0.1"):  # fmt: skip
            await asyncio.Event().wait()

    starting = asyncio.create_task(start())
    await async_wait_until(lambda: any(temp.glob("aegis-nats-*")), what="the server starting")
    [server_dir] = temp.glob("aegis-nats-*")
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert list(temp.iterdir()) == []
    servers = (p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"])
    assert [p.pid for p in servers if str(server_dir) in " ".join(p.info["cmdline"])] == []


def test_a_child_killed_by_a_signal_exits_as_a_shell_says() -> None:
    """asyncio's -15 given to ``sys.exit`` came out as 241."""
    assert [emulated.shell_status(c) for c in (-15, -2, 0, 3, 143)] == [143, 130, 0, 3, 143]


@pytest.mark.skipif(not unshare_works(), reason="needs unshare --net (root)")
async def test_a_run_in_the_cluster_namespace_killed_by_a_signal_exits_143() -> None:
    argv = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    assert await emulated.run_outside(argv) == 128 + signal.SIGTERM
    assert await emulated.run_outside([sys.executable, "-c", "raise SystemExit(3)"]) == 3


@pytest.mark.skipif(not unshare_works(), reason="needs unshare --net (root)")
def test_ctrl_z_stops_the_run_in_the_cluster_namespace_too_and_fg_goes_on() -> None:
    """The run inside the cluster's namespace is in a session of its own (a terminal's Ctrl-C
    reached it twice): Ctrl-Z (SIGTSTP to the run outside) stops it too, and SIGCONT (``fg``)
    lets both go on; then SIGTERM ends both."""
    inner = "import time\nwhile True: time.sleep(0.05)"
    code = (
        "import asyncio, sys; from aegis.platforms import emulated; "
        f"sys.exit(asyncio.run(emulated.run_outside([sys.executable, '-c', {inner!r}])))"
    )
    outer = subprocess.Popen([sys.executable, "-c", code])
    try:
        outside = psutil.Process(outer.pid)
        wait_until(lambda: [c for c in outside.children(recursive=True)
                            if c.cmdline()[-1:] == [inner]], 30, "the run inside")  # fmt: skip
        run = next(c for c in outside.children(recursive=True) if c.cmdline()[-1:] == [inner])

        def states() -> tuple[str, str]:
            return outside.status(), run.status()

        outer.send_signal(signal.SIGTSTP)
        stopped = (psutil.STATUS_STOPPED, psutil.STATUS_STOPPED)
        wait_until(lambda: states() == stopped, 30, "both stopped")
        outer.send_signal(signal.SIGCONT)
        wait_until(lambda: psutil.STATUS_STOPPED not in states(), 30, "both going on")
        outer.send_signal(signal.SIGTERM)
        assert outer.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if outer.poll() is None:
            outer.kill()
            outer.wait()


@pytest.mark.parametrize("ended_first", [False, True])
def test_each_signal_says_one_line(ended_first: bool, caplog: pytest.LogCaptureFixture) -> None:
    """(The second said that the pods are killed, then that the run was stopping already.)"""
    now = [0.0]
    stop = run_settings.RunStop(None, clock=lambda: now[0])
    stop.attach(lambda reason: None)
    stop.on_second(lambda: None)
    if ended_first:
        stop.ended()
    caplog.set_level(logging.WARNING, logger="aegis.platforms.run_settings")
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        stop.heard(sig)
        now[0] += 1.0
    said = [r.getMessage() for r in caplog.records]
    first = "SIGINT: the run is stopping already" if ended_first else "SIGINT: stopping the job"
    assert said == [first, "SIGINT again: the pods are killed now (what they had not saved is "
                    "lost)", "SIGTERM again: the pods are killed now (what they had not saved "
                    "is lost)"], said  # fmt: skip
