"""Appends every event the master feeds the core to ``events.jsonl`` (flushed per line).

A master that leads many jobs (``aegis master --log-dir D``) keeps one log per job, under
``D/<namespace>/<job>/events.jsonl`` (``job_log_dir``), each starting with its JobCreated line, so
``aegis replay``/``status``/``incidents`` read any of them (``--log-dir D`` finds the job's).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

from aegis.core.model import JobSpec
from aegis.wire import eventlog
from aegis.wire import messages as m

EVENTS = "events.jsonl"
SUBMISSION = ".submission"  # which submission of the job the log belongs to


def job_log_dir(root: Path, spec: JobSpec) -> Path:
    """Where a master that leads many jobs keeps this one's event log."""
    return root / spec.namespace / spec.job


def _mark(token: str) -> str:
    """Which submission a log belongs to (a digest: the token itself lets agents in)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def start_log(
    directory: Path,
    spec: JobSpec,
    nodes: list[str],
    ts: float,
    token: str,
    pod_ips: list[str] | None = None,
) -> bool:
    """Write the JobCreated line of a new job's log unless this submission's log has begun
    already (False then). A log left there by an earlier submission of the same name (another
    token) is kept aside as ``events.<n>.jsonl`` first."""
    directory.mkdir(parents=True, exist_ok=True)
    if belongs_to(directory, token):
        return False
    _set_aside(directory)
    with (directory / EVENTS).open("ab") as out:
        out.write(eventlog.encode(eventlog.job_created(spec, nodes, ts, pod_ips)))
    (directory / SUBMISSION).write_text(_mark(token))
    return True


def belongs_to(directory: Path, token: str) -> bool:
    """The log in ``directory`` has begun, for this submission of the job."""
    events, mark = directory / EVENTS, directory / SUBMISSION
    try:
        return events.stat().st_size > 0 and mark.read_text().strip() == _mark(token)
    except FileNotFoundError:
        return False


def _set_aside(directory: Path) -> None:
    events = directory / EVENTS
    if not events.exists():
        return
    n = 1
    while (directory / f"events.{n}.jsonl").exists():
        n += 1
    events.rename(directory / f"events.{n}.jsonl")
    (directory / SUBMISSION).unlink(missing_ok=True)


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
