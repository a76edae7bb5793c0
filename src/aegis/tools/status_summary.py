"""The summary of a job (``aegis status``) from its log directory: ``events.jsonl`` replayed,
the hardware reschedules counted from the actions. The summary itself, and the one from a
master's store record, are ``aegis.wire.job_summary``'s."""

from __future__ import annotations

from aegis.tools import incidents, joblog
from aegis.wire import job_summary


def from_log(log: joblog.JobLog) -> job_summary.Summary:
    return job_summary.summarize(log.spec, log.status, incidents.hardware_reschedules(log.steps))
