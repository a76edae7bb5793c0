"""Where a master replica keeps the event log of a job it adopts (``aegis master --log-dir D``:
``D/<namespace>/<job>/events.jsonl``, ``eventlog_writer``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from aegis.core.model import JobSpec, JobStatus, pods_by_rank
from aegis.core.phases import Phase
from aegis.master import eventlog_writer
from aegis.master.job_record import JobNotes

log = logging.getLogger(__name__)


def event_log_dir(
    root: Path | None, spec: JobSpec, status: JobStatus, notes: JobNotes
) -> Path | None:
    """The job's own event log under ``root``: begun here for a job no one has led yet,
    continued when it was begun (by the submitter or another replica sharing the directory);
    none when the job ran elsewhere before (its beginning is not here, and a log that cannot be
    replayed is worse than none), or when there is no ``root``."""
    if root is None:
        return None
    directory = eventlog_writer.job_log_dir(root, spec)
    if eventlog_writer.belongs_to(directory, notes.token):
        return directory
    if status.seq == 0 and status.phase is Phase.PENDING:
        nodes = notes.nodes or [str(info.node) for _, info in pods_by_rank(status)]
        eventlog_writer.start_log(directory, spec, nodes, time.time(), notes.token)
        return directory
    log.warning("job %s: led elsewhere before, no event log of it in %s; not logging it",
                spec.job, directory)  # fmt: skip
    return None
