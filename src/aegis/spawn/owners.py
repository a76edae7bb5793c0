"""A process named by its pid and its start time, as files left behind by one name their owner
(a progress file in ``/dev/shm``, an embedded NATS server's directory in /tmp): a pid alone may
be reused by another process once its owner is gone; with the start time it is not."""

from __future__ import annotations

from collections.abc import Callable

import psutil


def started_ms(pid: int) -> int | None:
    """When process ``pid`` started, in ms since the epoch (None: no such process)."""
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except psutil.Error:
        return None


def gone(pid: int, started: int, started_of: Callable[[int], int | None] = started_ms) -> bool:
    """Whether the process that had ``pid`` and started at ``started`` (ms) is gone."""
    return started_of(pid) != started
