"""What the agent tells the master when its command's process ends (pure: the link sends it).

An exit is reported once: not at all when it was stopped or restarted on an order, nor when it
was already reported as it began to exit (the dying report of an uncaught exception); a clean
exit is a Finish; anything else an Error (a command that could not start, 126 or 127, says why
in the output's last line) whose fault class is the one the output showed, unless
the output is not what ended it: a Python traceback in the log of a process that a signal
killed (the OOM killer, ...) is ``killed``, and one whose process exited with a status of its own
(Python exits 1 on an uncaught exception) has no class from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegis.agent import ports
from aegis.core.recovery import FaultClass


@dataclass(frozen=True, slots=True)
class Finished:
    """Exit status 0: the command is done."""


@dataclass(frozen=True, slots=True)
class Failed:
    reason: str
    fault_class: str


def on_exit(report: ports.ExitReport, dying_reported: bool) -> Finished | Failed | None:
    """The report an ended incarnation gets; None when it gets none."""
    if report.reason not in (ports.ExitReason.EXITED, ports.ExitReason.SPAWN_FAILED):
        return None  # stopped or restarted on an order: nothing to report
    if dying_reported and report.exit_status != 0:
        return None  # reported as it began to exit
    if report.exit_status == 0:
        return Finished()
    reason = f"exit status {report.exit_status}"
    if report.exit_status in NOT_STARTED and (said := _last_line(report.evidence)):
        reason = f"{reason}: {said}"  # what the shell (or the agent) said it could not start
    return Failed(reason, exit_fault_class(report))


# A shell's statuses for a command it could not run (126: not executable, 127: not found), as
# the agent's own for a program it could not execute: the last line of output says which.
NOT_STARTED = frozenset({126, 127})
SAID_CHARS = 200


def _last_line(evidence: ports.Evidence) -> str:
    lines = [x.strip() for x in evidence.last_lines if x.strip()]
    return lines[-1][:SAID_CHARS] if lines else ""


def exit_fault_class(report: ports.ExitReport) -> str:
    """The fault class of a failed exit: the output's, unless the output did not end it."""
    cls = report.evidence.fault_class or ""
    if cls == FaultClass.PYTHON_TRACEBACK and (
        report.signal is not None or report.exit_status != 1
    ):
        return FaultClass.KILLED if report.signal is not None else ""
    return cls
