"""The agent's two ports: what the supervisor reports, and how the training is driven.

The dependency goes one way. The supervisor reports facts through :class:`AgentReports`; the
master link (:mod:`aegis.agent.link`) turns them into Error/Hang/Finish messages on NATS and
never reads the supervisor. The order executor (:mod:`aegis.agent.executor`) drives the training
through :class:`Training` (start, restart, stop, a checkpoint request, a look at its progress).
Two more :class:`AgentReports` live here: :class:`RecordingReports` (in memory, for tests and
embedding) and :class:`LoggingReports` (standalone: a log line each).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Mapping
from typing import Protocol, TypeVar

from aegis.core.recovery import FaultClass as FaultClass  # noqa: PLC0414 (re-exported)

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class ExitReason(enum.StrEnum):
    EXITED = "exited"  # the command ended on its own
    STOPPED = "stopped"  # the agent stopped it (its own stop, or an order)
    RESTARTED = "restarted"  # the agent stopped it to start it again in place
    SPAWN_FAILED = "spawn_failed"  # the command could not be executed (127/126)


@dataclasses.dataclass(frozen=True, slots=True)
class SignatureMatch:
    fault_class: str
    signature: str
    stream: str
    line: str
    detail: str = ""  # for a traceback: its last frame line


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    fault_class: str | None
    matches: tuple[SignatureMatch, ...]
    last_lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ExitReport:
    pid: int
    restart_count: int
    exit_status: int  # shell style: the code, or 128+N after signal N
    signal: int | None
    reason: ExitReason
    evidence: Evidence
    step: int | None = None  # where it ended (``incarnation.step_at_end``); None: not known


@dataclasses.dataclass(frozen=True, slots=True)
class DyingReport:
    """The command's process said it is exiting on an uncaught exception (``aegis.training``'s
    hook, after the traceback): the fault is known before the interpreter has finished, which
    for a torch process takes 0.5-1 s here. Its ``ExitReport`` follows when it is gone."""

    pid: int
    restart_count: int
    exception: str  # the exception's type name
    evidence: Evidence  # what the output showed so far (the traceback included)
    step: int | None = None  # where it is ending (``incarnation.step_at_end``)


@dataclasses.dataclass(frozen=True, slots=True)
class StackDump:
    pid: int
    cmdline: str
    text: str
    error: str | None  # why no dump (ptrace denied, py-spy missing, not Python), else None
    flight: str = ""  # torch's flight recorder, summed up in one line (where it is on)
    state: str = ""  # ``suspects.state_line``: where the kernel holds the process, else ""

    def section(self) -> str:
        """The process's part of a hang report: its header, where the kernel holds it (if it
        does), its stack (or why none), the flight recorder's line."""
        body = self.text if self.error is None else self.error
        head = f"--- pid {self.pid} ({self.cmdline}) ---" + (
            f"\n{self.state}" if self.state else ""
        )
        return f"{head}\n{body}" + (f"\n{self.flight}" if self.flight else "")


@dataclasses.dataclass(frozen=True, slots=True)
class HangReport:
    restart_count: int
    timeout_s: float
    idle_s: float
    last_step: int | None  # None when the command never called aegis.progress()
    last_activity_ts: float  # time.monotonic() of the last progress (or output)
    detected_ts: float  # time.monotonic() when the hang was declared
    stacks: tuple[StackDump, ...]
    why: str = ""  # how the timeout was chosen (``hang_policy``)
    no_step_signal: bool = False  # judged by output and CPU alone (no step seen in the run)


@dataclasses.dataclass(frozen=True, slots=True)
class FaultReport:
    pid: int
    restart_count: int
    match: SignatureMatch


class AgentReports(Protocol):
    """What the agent tells the outside world; calls should not raise (failures are logged)."""

    async def child_exited(self, report: ExitReport) -> None: ...

    async def child_dying(self, report: DyingReport) -> None: ...

    async def hang_detected(self, report: HangReport) -> None: ...

    async def fault_seen(self, report: FaultReport) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """One look at the training: what it reported through ``aegis.progress()`` and the file."""

    step: int | None = None  # the last step of the running incarnation, None if none yet
    step_ts: float | None = None  # time.monotonic() when that step ended
    input_s: float | None = None  # its last input time (a step's end to the next forward)
    ever_stepped: bool = False  # some incarnation of this agent reported a step
    takes_checkpoint_requests: bool = False  # it said it saves on request
    hang_timeout: str = ""  # the watchdog's current timeout and how it was chosen
    # the step of the script's last own save, once the training has gone past it (the save,
    # and whatever the script does with the file, such as a rename, is done); None: none
    saved_step: int | None = None
    hung: bool = False  # the watchdog's reported hang stands (no progress since)


class Training(Protocol):
    """What the order executor drives (the supervisor): the narrow port of the orders."""

    @property
    def running(self) -> bool: ...

    @property
    def restart_count(self) -> int: ...  # the incarnation's AEGIS_RESTART_COUNT

    async def start(self, env: Mapping[str, str] | None = None) -> None: ...

    async def restart(self, env: Mapping[str, str] | None = None) -> None: ...

    async def stop(self) -> ExitReport | None: ...

    def request_checkpoint(self, request_id: int, target_step: int, hold_s: float) -> None: ...

    def progress(self) -> Progress: ...


class RecordingReports:
    """In-memory :class:`AgentReports`: keeps every report and wakes waiters."""

    def __init__(self) -> None:
        self.exits: list[ExitReport] = []
        self.dying: list[DyingReport] = []
        self.hangs: list[HangReport] = []
        self.faults: list[FaultReport] = []
        self._changed = asyncio.Condition()

    async def child_exited(self, report: ExitReport) -> None:
        await self._add(self.exits, report)

    async def child_dying(self, report: DyingReport) -> None:
        await self._add(self.dying, report)

    async def hang_detected(self, report: HangReport) -> None:
        await self._add(self.hangs, report)

    async def fault_seen(self, report: FaultReport) -> None:
        await self._add(self.faults, report)

    async def _add(self, into: list[_R], report: _R) -> None:
        async with self._changed:
            into.append(report)
            self._changed.notify_all()

    async def wait_for(self, what: str, count: int = 1) -> None:
        """Wait until at least ``count`` reports of kind ``what`` (exits|dying|hangs|faults)
        are in."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(getattr(self, what)) >= count)


class LoggingReports:
    """Standalone :class:`AgentReports`: one log line per report, nothing sent anywhere."""

    async def child_exited(self, report: ExitReport) -> None:
        evidence = report.evidence
        if report.reason is ExitReason.EXITED and evidence.fault_class is not None:
            log.warning(
                "command exited with status %s (fault class: %s)%s",
                report.exit_status,
                evidence.fault_class or "unknown",
                "".join(f"\n  {m.fault_class}: {m.line}" for m in evidence.matches[-5:]),
            )

    async def child_dying(self, report: DyingReport) -> None:
        log.info("pid %s is exiting on an uncaught %s", report.pid, report.exception)

    async def hang_detected(self, report: HangReport) -> None:
        stacks = "".join(f"\n{s.section()}" for s in report.stacks)
        log.warning(
            "hang: no progress for %.1f s (timeout %.1f s, last step %s)%s",
            report.idle_s,
            report.timeout_s,
            report.last_step,
            stacks,
        )

    async def fault_seen(self, report: FaultReport) -> None:
        log.info("fault signature %s: %s", report.match.fault_class, report.match.line)
