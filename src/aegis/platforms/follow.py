"""Following a job whose master runs in another process (``aegis run --masters N``).

The leader appends every event it feeds the core to ``events.jsonl``; ``FollowedJob`` reads the
lines as they arrive and feeds them through the same production ``step`` (as ``aegis replay``
does), then calls its listeners the way a ``JobRunner`` calls its observers. So the run views
(live table, plain lines) work unchanged on a job led elsewhere.

What it shows is the log's account: after a takeover the new leader continues from the status it
loaded from the store, so events the old leader logged but never persisted can make the two
differ for a moment. The job's outcome is always read from the store, never from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus
from aegis.wire import eventlog

log = logging.getLogger(__name__)

Listener = Callable[["FollowedJob", ev.Event, tuple[act.Action, ...]], None]


class FollowedJob:
    def __init__(self, path: Path, spec: JobSpec, status: JobStatus, offset: int) -> None:
        """Use ``open``."""
        self.path, self.spec, self.status = path, spec, status
        self.listeners: list[Listener] = []
        # the log keeps the core's events, not the agents' messages or heartbeats: these are
        # never called (a view shows no per-pod step; checkpoint commits still advance it)
        self.message_listeners: list[Callable[[FollowedJob, Any], None]] = []
        self.heartbeat_listeners: list[Callable[[FollowedJob, Any], None]] = []
        self.bad_lines = 0
        self._offset = offset
        self._partial = b""
        self._line = 1
        self._now = time.time()

    @classmethod
    def open(cls, path: Path) -> FollowedJob:
        """From the log's JobCreated line (written before the job starts). Raises
        ``eventlog.EventLogError`` when it is missing or unreadable."""
        with path.open("rb") as log_file:
            first = log_file.readline()
        if not first.endswith(b"\n"):
            raise eventlog.EventLogError(1, "no whole JobCreated line yet")
        spec, status, _ = eventlog.read(iter([first.decode(errors="replace")]))
        return cls(path, spec, status, len(first))

    def clock(self) -> float:
        """The time of the last event read (the master's clock), as a runner's ``clock``."""
        return self._now

    def poll(self) -> int:
        """Handle every whole line appended since the last call; returns how many."""
        try:
            with self.path.open("rb") as log_file:
                log_file.seek(self._offset)
                data = log_file.read()
        except FileNotFoundError:
            return 0
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        handled = 0
        for raw in lines:
            self._line += 1
            text = raw.decode(errors="replace")
            if text.strip():
                handled += self._handle(text)
        return handled

    def _handle(self, text: str) -> int:
        try:
            entry = eventlog.entry(self.spec, self._line, text)
        except eventlog.EventLogError as exc:
            self.bad_lines += 1
            log.warning("%s: %s (skipped)", self.path, exc)
            return 0
        if entry.event is None:
            return 1
        self._now = entry.ts
        self.status, actions = machine.step(self.spec, self.status, entry.event, entry.ts)
        for listener in self.listeners:
            try:
                listener(self, entry.event, actions)
            except Exception:  # a view that fails must not stop the run it shows
                log.exception("%s: a listener failed on line %d", self.path, self._line)
        return 1

    async def follow(self, stop: asyncio.Event, poll_s: float = 0.1) -> None:
        """Poll until ``stop`` is set, then read what is left once more."""
        while not stop.is_set():
            self.poll()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(poll_s):
                    await stop.wait()
        self.poll()
