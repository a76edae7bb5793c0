"""``aegis replay``: feed a recorded event log through the production ``step``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from aegis.core import actions as act
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus
from aegis.wire import eventlog


@dataclass(frozen=True, slots=True)
class Replayed:
    entry: eventlog.Entry
    status: JobStatus
    actions: tuple[act.Action, ...]


def replay(lines: Iterable[str]) -> tuple[JobSpec, JobStatus, Iterator[Replayed]]:
    """The spec, the initial status and, lazily, the status after each event.

    Raises ``eventlog.EventLogError`` (with the line number) on a line that cannot be read; the
    iterator raises it when it reaches that line.
    """
    spec, status, entries = eventlog.read(iter(lines))
    return spec, status, _run(spec, status, entries)


def _run(spec: JobSpec, status: JobStatus, entries: Iterator[eventlog.Entry]) -> Iterator[Replayed]:
    for entry in entries:
        if entry.event is None:
            continue
        status, actions = machine.step(spec, status, entry.event, entry.ts)
        yield Replayed(entry, status, actions)


def final_status(lines: Iterable[str]) -> tuple[JobSpec, JobStatus]:
    spec, status, steps = replay(lines)
    for replayed in steps:
        status = replayed.status
    return spec, status
