"""Appends every event the master feeds the core to ``events.jsonl`` (flushed per line).

A master that leads many jobs (``aegis master --log-dir D``) keeps one log per job, under
``D/<namespace>/<job>/events.jsonl`` (``job_log_dir``), each starting with its JobCreated line, so
``aegis replay``/``status``/``incidents`` read any of them (``--log-dir D`` finds the job's).

A line that cannot be written (a full disk, an I/O error) is lost, not fatal: the job goes on
(the log is its record, not its state, which is in the status store), the error is logged once
per outage, the lost lines are counted (``lost``), and the file is cut back to its last whole
line so that its readers never meet a torn one. Before, a full log disk ended the job's loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import BinaryIO

from aegis.core.model import JobSpec
from aegis.wire import eventlog
from aegis.wire import messages as m

log = logging.getLogger(__name__)

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
        self.lost = 0  # lines that could not be written
        self._failing = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab", buffering=0)

    def write(self, record: eventlog.PlatformRecord | m.Message) -> None:
        if self._file is None:
            return
        line, fd = eventlog.encode(record), self._file.fileno()
        end: int | None = None  # the file's size before this line
        try:
            end = os.fstat(fd).st_size
            written = 0
            while written < len(line):  # an unbuffered write may take a part
                written += self._file.write(line[written:]) or 0
        except OSError as exc:
            if end is not None:  # not a whole line: cut back to the last one
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
            self.lost += 1
            if not self._failing:
                log.error("%s: a line could not be written (%s); the job goes on, and the lines "
                          "lost meanwhile are counted", self.path, exc)  # fmt: skip
            self._failing = True
            return
        if self._failing:
            log.warning("%s: written again (%d lines lost so far)", self.path, self.lost)
            self._failing = False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
