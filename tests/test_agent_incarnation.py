"""An incarnation's environment and exit report (pure), and the agent's guarded tasks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from aegis import autoprogress, flight
from aegis import training as progress
from aegis.agent import incarnation, ports, signatures, tasks


def test_an_incarnation_gets_its_count_the_progress_file_the_override_and_the_hooks() -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/mine", "MASTER_PORT": "1"}
    env, flight_request = incarnation.child_env(base, 2, "/dev/shm/p", {"MASTER_PORT": "2"})
    assert env[incarnation.RESTART_COUNT_VAR] == "2" and env[progress.ENV_VAR] == "/dev/shm/p"
    assert env["MASTER_PORT"] == "2" and env["PATH"] == "/bin"
    assert env[autoprogress.PATH_VAR] == os.pathsep.join([autoprogress.SITE_DIR, "/mine"])
    assert flight_request is None and flight.REQUEST_VAR not in env


def test_the_flight_recorder_answers_next_to_the_progress_file_and_the_hooks_can_be_off() -> None:
    base = {flight.SIZE_VARS[0]: "2000", autoprogress.OFF_VAR: "0", "PYTHONPATH": "/mine"}
    env, flight_request = incarnation.child_env(base, 0, "/dev/shm/p", {})
    assert flight_request == env[flight.REQUEST_VAR] == "/dev/shm/p.fr"
    assert env["PYTHONPATH"] == "/mine"


def _inc(restart_count: int = 1) -> incarnation.Incarnation:
    done: asyncio.Future[ports.ExitReport] = asyncio.get_running_loop().create_future()
    return incarnation.Incarnation(42, restart_count, signatures.Scanner(()), done)


async def test_an_exit_report_says_the_status_the_signal_and_a_segfaults_class() -> None:
    crashed = incarnation.exit_report(_inc(), signal.SIGSEGV, step=7)
    assert (crashed.pid, crashed.restart_count, crashed.exit_status, crashed.signal) == (
        42, 1, 128 + signal.SIGSEGV, signal.SIGSEGV,
    )  # fmt: skip
    assert crashed.evidence.fault_class == ports.FaultClass.SEGFAULT
    assert crashed.reason is ports.ExitReason.EXITED and crashed.step == 7
    clean = incarnation.exit_report(_inc(), 3 << 8, step=None)  # exit(3)
    assert (clean.exit_status, clean.signal, clean.evidence.fault_class) == (3, None, None)


def test_a_command_that_cannot_run_ends_127_or_126_as_a_shell_says() -> None:
    missing = FileNotFoundError(2, "No such file or directory")
    line, report = incarnation.spawn_failed("nope", missing, 0, signatures.Scanner(()), 40)
    assert line == "aegis agent: cannot execute nope: No such file or directory"
    assert (report.exit_status, report.reason, report.step) == (
        127,
        ports.ExitReason.SPAWN_FAILED,
        40,
    )
    denied = PermissionError(13, "Permission denied")
    assert incarnation.spawn_failed("x", denied, 0, signatures.Scanner(()), 0)[1].exit_status == 126


async def test_a_background_task_that_fails_is_logged_and_close_cancels_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    background = tasks.Background()

    async def fails() -> None:
        raise RuntimeError("boom")

    forever = background.start(asyncio.Event().wait(), "forever")  # type: ignore[arg-type]
    failing = background.start(fails(), "fails")
    await asyncio.wait({failing})  # its own done callback (the log) ran first
    assert any("agent task fails failed" in r.getMessage() for r in caplog.records)
    await background.close()
    assert forever.cancelled()


async def test_an_incarnation_that_never_stepped_ends_at_the_step_it_started_from() -> None:
    assert incarnation.start_step({}) == 0
    assert incarnation.start_step({"AEGIS_RESUME_STEP": "120"}) == 120
    assert incarnation.start_step({"AEGIS_RESUME_STEP": "-3"}) == 0  # not a step: from 0
    resumed = dataclasses.replace(_inc(), start_step=120)
    soon = resumed.started + 5.0
    assert incarnation.step_at_end(None, resumed, ever_stepped=False, now=soon) == 120
    assert incarnation.step_at_end(127, resumed, ever_stepped=False, now=soon) == 127
    assert incarnation.step_at_end(None, _inc(), ever_stepped=False, now=soon) == 0


async def test_a_job_with_no_step_signal_that_ran_past_the_start_knows_no_step() -> None:
    # its faults hours apart (a peer's closed connection each time) are not one fault repeated
    inc, window = _inc(), incarnation.START_WINDOW_S
    late = inc.started + window + 1.0
    assert incarnation.step_at_end(None, inc, ever_stepped=False, now=late) is None
    # a job that stepped before (another incarnation) failed to start this time: at its start
    assert incarnation.step_at_end(None, inc, ever_stepped=True, now=late) == 0
