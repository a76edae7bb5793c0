"""The agent's background tasks: each one named, and guarded so that an unexpected exit is
logged, never silent (a guarded task ends without raising, except when cancelled)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger(__name__)

Job = Coroutine[Any, Any, None]


async def guarded(coro: Job, name: str) -> None:
    """Run ``coro``; log what it raises (a cancellation goes through)."""
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("agent task %s failed", name)


class Background:
    """Tasks that run beside their owner's, until they end or :meth:`close` cancels them; what
    one of them raises is logged when it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coro: Job, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("agent task %s failed", task.get_name(), exc_info=error)

    async def close(self) -> None:
        """Cancel what still runs and wait for it to end."""
        running = list(self._tasks)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
