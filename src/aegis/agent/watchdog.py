"""Hang detection: no progress (or, for scripts that never report progress, no output) for too long.

The agent side of :mod:`aegis.training`: :class:`ProgressFile` creates and reads the shared
file; :func:`watch` declares a hang once per idle spell, collects stack dumps and reports. It never
kills anything (seed 7.3: mark first, decide later).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Awaitable, Callable

from aegis import training as progress
from aegis.agent import ports

log = logging.getLogger(__name__)


class ProgressFile:
    """The shared file training processes write ``aegis.progress()`` into."""

    def __init__(self) -> None:
        directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        fd, self.path = tempfile.mkstemp(prefix="aegis-progress-", dir=directory)
        try:
            os.ftruncate(fd, progress.SIZE)
            self._map = mmap.mmap(fd, progress.SIZE)
        finally:
            os.close(fd)

    def reset(self) -> None:
        """A new incarnation: no progress, no checkpoint request, not opted in."""
        self._map[:] = bytes(progress.SIZE)

    def request_checkpoint(self, request_id: int, target_step: int, hold_until: float) -> None:
        """Ask the training to save at ``target_step`` (or at once, if past it) and to hold
        until ``hold_until`` (``time.monotonic()``) afterwards; ids only grow."""
        progress.REQUEST_ONLY.pack_into(
            self._map, progress.REQUEST_AT, request_id, target_step, hold_until
        )

    def answered(self) -> int:
        """The id of the last request the training saved for (0: none)."""
        return int(progress.ANSWERED.unpack_from(self._map, progress.ANSWERED_AT)[0])

    def opted_in(self) -> bool:
        """Whether the training takes checkpoint requests (``save_if_requested`` was called)."""
        return bool(progress.OPTED_IN.unpack_from(self._map, progress.OPTED_IN_AT)[0])

    def read(self) -> tuple[int, float] | None:
        """(step, monotonic time) of the last report, None when there was none since reset."""
        step, ts = progress.LAYOUT.unpack_from(self._map, 0)
        return None if ts == 0.0 else (int(step), float(ts))

    def close(self) -> None:
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclasses.dataclass(frozen=True, slots=True)
class WatchSettings:
    timeout_s: float
    restart_count: int


Activity = Callable[[], float]  # monotonic time of the last output (or of the start)
Collect = Callable[[], Awaitable[tuple[ports.StackDump, ...]]]
Report = Callable[[ports.HangReport], Awaitable[None]]
SetHung = Callable[[bool], None]


async def watch(
    settings: WatchSettings,
    progress_file: ProgressFile,
    last_output: Activity,
    collect: Collect,
    report: Report,
    set_hung: SetHung,
) -> None:
    """Run until cancelled; report each idle spell longer than the timeout once."""
    interval = min(0.1, settings.timeout_s / 10)
    hung = False
    while True:
        await asyncio.sleep(interval)
        seen = progress_file.read()
        last_step = None if seen is None else seen[0]
        last = last_output() if seen is None else seen[1]
        now = time.monotonic()
        if now - last < settings.timeout_s:
            if hung:
                log.warning("progress again after a hang")
                hung = False
                set_hung(False)
            continue
        if hung:
            continue
        hung = True
        set_hung(True)
        log.warning("no progress for %.1f s: collecting stack dumps", now - last)
        stacks = await collect()
        await report(
            ports.HangReport(
                restart_count=settings.restart_count,
                timeout_s=settings.timeout_s,
                idle_s=now - last,
                last_step=last_step,
                last_activity_ts=last,
                detected_ts=now,
                stacks=stacks,
            )
        )
