"""Appends every event the master feeds the core to ``events.jsonl`` (flushed per line).

A master that leads many jobs (``aegis master --log-dir D``) keeps one log per job, under
``D/<namespace>/<job>/events.jsonl`` (``job_log_dir``), each starting with its JobCreated line, so
``aegis replay``/``status``/``incidents`` read any of them (``--log-dir D`` finds the job's).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from aegis.core.model import JobSpec
from aegis.wire import eventlog
from aegis.wire import messages as m

EVENTS = "events.jsonl"


def job_log_dir(root: Path, spec: JobSpec) -> Path:
    """Where a master that leads many jobs keeps this one's event log."""
    return root / spec.namespace / spec.job


def start_log(directory: Path, spec: JobSpec, nodes: list[str], ts: float) -> bool:
    """Write the JobCreated line of a new job's log unless the log has begun already; False
    when it had (another replica, or the submitter, began it)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / EVENTS
    with path.open("ab") as out:
        if out.tell() > 0:
            return False
        out.write(eventlog.encode(eventlog.job_created(spec, nodes, ts)))
    return True


class EventLogWriter:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")

    def write(self, record: eventlog.PlatformRecord | m.Message) -> None:
        if self._file is not None:
            self._file.write(eventlog.encode(record))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
