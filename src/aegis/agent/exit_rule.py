"""What the agent tells the master when its command's process ends (pure: the link sends it).

An exit is reported once: not at all when it was stopped or restarted on an order, nor when it
was already reported as it began to exit (the dying report of an uncaught exception); a clean
exit is a Finish; anything else an Error whose fault class is the one the output showed, unless
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
    return Failed(f"exit status {report.exit_status}", exit_fault_class(report))


def exit_fault_class(report: ports.ExitReport) -> str:
    """The fault class of a failed exit: the output's, unless the output did not end it."""
    cls = report.evidence.fault_class or ""
    if cls == FaultClass.PYTHON_TRACEBACK and (
        report.signal is not None or report.exit_status != 1
    ):
        return FaultClass.KILLED if report.signal is not None else ""
    return cls
