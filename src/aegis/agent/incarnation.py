"""One run of the training command under the supervisor (an incarnation), and what is decided
about it without I/O: its environment and its exit report."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import signal
import time
from collections.abc import Mapping

from aegis import autoprogress, flight
from aegis import training as progress
from aegis.agent import ports, pump, reaper, signatures

RESTART_COUNT_VAR = "AEGIS_RESTART_COUNT"


@dataclasses.dataclass(slots=True, eq=False)
class Incarnation:
    pid: int
    restart_count: int
    scanner: signatures.Scanner
    done: asyncio.Future[ports.ExitReport]
    status: asyncio.Future[int] | None = None  # the raw wait status (reaper's or nanny's)
    warm: bool = False
    last_output_ts: float = dataclasses.field(default_factory=time.monotonic)
    started: float = dataclasses.field(default_factory=time.monotonic)
    reason: ports.ExitReason | None = None
    terminator: asyncio.Task[None] | None = None
    watchdog: asyncio.Task[None] | None = None
    pumps: list[tuple[asyncio.ReadTransport, pump.LinePump]] = dataclasses.field(
        default_factory=list
    )
    reported: set[str] = dataclasses.field(default_factory=set)
    hung: bool = False
    dying: bool = False  # its process said it is exiting (reported once)
    start_step: int = 0  # the step it starts from (``start_step``)

    def heard(self) -> None:
        """It wrote something (a line, or a progress bar's ``\r`` update)."""
        self.last_output_ts = time.monotonic()


def child_env(
    base: Mapping[str, str], restart_count: int, progress_path: str, override: Mapping[str, str]
) -> tuple[dict[str, str], str | None]:
    """An incarnation's environment: the supervisor's plus its restart count, the progress
    file, the override of the start, a ``PYTHONPATH`` with the progress hooks first (every
    Python process of the command gets them at start-up); and where its flight recorder
    answers a hang (None when it is off)."""
    env = {
        **base,
        RESTART_COUNT_VAR: str(restart_count),
        progress.ENV_VAR: progress_path,
        **override,
    }
    path = autoprogress.pythonpath(env)
    if path is not None:
        env[autoprogress.PATH_VAR] = path
    flight_request = None
    if flight.recording(env):
        flight_request = env[flight.REQUEST_VAR] = progress_path + ".fr"
    return env, flight_request


def start_step(env: Mapping[str, str]) -> int:
    """The step an incarnation starts from: the one the master had every rank resume from
    (``AEGIS_RESUME_STEP``), else 0 (its steps are counted from its start)."""
    text = env.get(autoprogress.RESUME_STEP_VAR, "")
    return int(text) if text.isdigit() else 0


START_WINDOW_S = 300.0  # an incarnation that never stepped and ended within this: a start-up crash


def step_at_end(
    last_step: int | None, inc: Incarnation, *, ever_stepped: bool, now: float
) -> int | None:
    """Where ``inc`` ends: the step it last reported; when it reported none, the step it
    started from if it failed to start (it ended within ``START_WINDOW_S``, or an earlier
    incarnation of the pod stepped: the job has a step signal). A crash before the first step
    (a bad import, a missing file, a model that does not fit) is then at that step in every
    incarnation, so three in a row end the job (``core.recovery.run_after``) instead of
    spending the whole budget. None (no step known) for a job with no step signal that ran
    past the window: its faults hours apart are not one fault repeated."""
    if last_step is not None:
        return last_step
    if ever_stepped or now - inc.started <= START_WINDOW_S:
        return inc.start_step
    return None


def exit_report(inc: Incarnation, raw: int, step: int | None) -> ports.ExitReport:
    """How ``inc`` ended, from its raw wait status; a segfault's class when the output had none."""
    code = os.waitstatus_to_exitcode(raw)
    sig = -code if code < 0 else None
    fallback = ports.FaultClass.SEGFAULT if sig in (signal.SIGSEGV, signal.SIGBUS) else None
    return ports.ExitReport(
        pid=inc.pid,
        restart_count=inc.restart_count,
        exit_status=reaper.exit_status(raw),
        signal=sig,
        reason=inc.reason or ports.ExitReason.EXITED,
        evidence=inc.scanner.evidence(fallback_class=fallback),
        step=step,
    )


def spawn_failed(
    argv0: str, exc: OSError, restart_count: int, scanner: signatures.Scanner, step: int
) -> tuple[str, ports.ExitReport]:
    """The line to print and the report of a command that could not be executed (status 127
    when it is not found, else 126, as a shell says) at ``step``, the one it would start from."""
    status = 127 if exc.errno == errno.ENOENT else 126
    message = f"aegis agent: cannot execute {argv0}: {exc.strerror}"
    scanner.feed("agent", message)
    report = ports.ExitReport(pid=0, restart_count=restart_count, exit_status=status,
                              signal=None, reason=ports.ExitReason.SPAWN_FAILED,
                              evidence=scanner.evidence(), step=step)  # fmt: skip
    return message, report
