"""Why a job ended, read from its final status: the kind of ending (an AegisJob's ``Failed``
condition reason, ``aegis status --json``'s ``ending``). The master's own words for it (the
``EndJob`` reason: "fault budget exhausted", the repeat verdict, "no healthy node left for
x-1", "stopped by aegis ctl") travel beside the status (``JobNotes.ended``; replayed from an
event log), since a stop's cause is not part of the state machine's state.
"""

from __future__ import annotations

import enum

from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Phase


class Ending(enum.StrEnum):
    SUCCEEDED = "Succeeded"  # every pod finished with exit code 0
    BUDGET_EXHAUSTED = "BudgetExhausted"  # more faults than max_retry
    REPEATED_FAULT = "RepeatedFault"  # the same fault repeat_limit times in a row (restart or stop)
    STOPPED = "Stopped"  # from outside: aegis ctl stop, a signal, a pod no node could take
    FAILED = "Failed"  # Failed without should_quit: not a status the core makes (a bad record)


def ending(spec: JobSpec, status: JobStatus) -> Ending | None:
    """How the job ended; None while it runs. A fault that spends the budget and also
    completes a run of the same fault ends it as budget exhausted (the core says so first)."""
    if status.phase is Phase.SUCCEED:
        return Ending.SUCCEEDED
    if status.phase is not Phase.FAILED:
        return None
    if status.recover_count > spec.max_retry:
        return Ending.BUDGET_EXHAUSTED
    if not status.should_quit:
        return Ending.FAILED
    if spec.repeat_limit and status.repeat_count >= spec.repeat_limit:
        return Ending.REPEATED_FAULT
    return Ending.STOPPED


def restarts(spec: JobSpec, status: JobStatus) -> int:
    """The recoveries the fault budget paid for (the seed's "restarted M times"): the counted
    faults, but not one that ended the job by the budget (the status then holds
    ``max_retry + 1``) or by the repeat rule (it counted the fault that stopped it). A job
    stopped from outside between a counted fault and its restart (a check round, a pod
    awaiting its replacement) still counts that fault: the status does not say it."""
    if ending(spec, status) is Ending.REPEATED_FAULT:
        return max(0, min(status.recover_count - 1, spec.max_retry))
    return min(status.recover_count, spec.max_retry)
