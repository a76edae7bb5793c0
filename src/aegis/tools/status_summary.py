"""The summary of a job (``aegis status``) from its log directory: ``events.jsonl`` replayed,
the hardware reschedules counted and the reason it ended (the ``EndJob``'s) taken from the
actions. The summary itself, and the one from a master's store record, are
``aegis.wire.job_summary``'s."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.tools import incidents, joblog
from aegis.wire import job_summary


def from_log(log: joblog.JobLog) -> job_summary.Summary:
    ended = [a.reason for done in log.steps for a in done.actions if isinstance(a, act.EndJob)]
    return job_summary.summarize(
        log.spec,
        log.status,
        incidents.hardware_reschedules(log.steps),
        ended=ended[-1] if ended else "",
    )
