"""A job's log directory as the operator's tools read it: find it, replay its ``events.jsonl``.

``aegis run`` without ``--log-dir`` writes to ``$TMPDIR/aegis-run-*``; ``find_log_dir`` picks
the newest such directory whose event log belongs to the job.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aegis.core.errors import RemoteError
from aegis.core.model import JobSpec, JobStatus
from aegis.tools import replay
from aegis.wire import eventlog

EVENTS = "events.jsonl"
LOG_DIR_ENV = "AEGIS_LOG_DIR"


class LogDirError(RemoteError):
    """No readable log directory for the job."""


@dataclass(frozen=True, slots=True)
class JobLog:
    log_dir: Path
    spec: JobSpec
    initial: JobStatus
    steps: tuple[replay.Replayed, ...]
    torn_tail: str = ""  # a last line cut short (left out): the master is writing it, or died

    @property
    def status(self) -> JobStatus:
        return self.steps[-1].status if self.steps else self.initial


def _job_of(events: Path) -> str | None:
    try:
        with events.open(errors="replace") as lines:
            head = json.loads(lines.readline() or "{}")
    except (OSError, ValueError):
        return None
    spec = head.get("spec") if isinstance(head, dict) else None
    return spec.get("job") if isinstance(spec, dict) else None


def find_log_dir(job: str, log_dir: Path | None = None) -> Path:
    """``log_dir`` (or ``$AEGIS_LOG_DIR``) when given, else the newest ``aegis run`` directory of
    the job in the temporary directory. A master's log directory holds one directory per job
    (``<namespace>/<job>/``, also under ``aegis run --masters N``): the job's is found there."""
    given = log_dir or (Path(os.environ[LOG_DIR_ENV]) if os.environ.get(LOG_DIR_ENV) else None)
    if given is not None:
        if not (given / EVENTS).is_file():
            led = [p.parent for p in given.glob(f"*/{job}/{EVENTS}") if _job_of(p) == job]
            if len(led) == 1:
                return led[0]
            if len(led) > 1:
                spaces = ", ".join(sorted(d.parent.name for d in led))
                where = f"{given}/NAMESPACE/{job}"
                detail = f"job {job!r} in several namespaces ({spaces}): pass --log-dir {where}"
                raise LogDirError("no_log", detail=detail)
            raise LogDirError("no_log", detail=f"no {EVENTS} in {given}")
        owner = _job_of(given / EVENTS)
        if owner != job:
            raise LogDirError("wrong_job", detail=f"{given} holds job {owner!r}, not {job!r}")
        return given
    found = [
        events.parent
        for events in Path(tempfile.gettempdir()).glob(f"aegis-run-*/{EVENTS}")
        if _job_of(events) == job
    ]
    if not found:
        raise LogDirError("no_log", detail=f"no log directory of job {job!r}; pass --log-dir DIR")
    return max(found, key=lambda d: (d / EVENTS).stat().st_mtime)


def load(log_dir: Path) -> JobLog:
    """Replay the job's event log (raises ``eventlog.EventLogError`` on a bad line)."""
    text = (log_dir / EVENTS).read_text(errors="replace")  # a torn character too
    lines, torn = eventlog.whole_lines(text)
    spec, initial, steps = replay.replay(lines)
    return JobLog(log_dir, spec, initial, tuple(steps), torn)


def torn_note(events: Path, tail: str) -> str:
    """One line for stderr about a torn last line of ``events`` (left out of what is shown)."""
    return (f"aegis: note: the last line of {events} is incomplete ({len(tail)} characters: "
            "the master is writing it, or stopped while it did); left out")  # fmt: skip
