"""Cancellation that survives Python 3.11's ``asyncio.wait_for``.

In 3.11, ``wait_for`` returns the inner result when a cancellation arrives just as the inner
future completes, and turns a cancellation that arrives while it is cancelling a timed-out inner
future into ``TimeoutError`` (both fixed in 3.12). nats-py waits for every reply with
``wait_for``, so a loop that retries on errors (polling the status bucket, renewing the lease)
can lose the one cancellation meant to stop it, and run forever: a CI run hung 90 s in a test's
teardown that way. Such loops call ``raise_if_cancelled`` each time round: the task still
remembers that it was asked to stop (``Task.cancelling``). They compare against the count at
their start (``cancellations``), because 3.11's ``TaskGroup`` can leave one behind that nobody
meant for them (a child that fails while the group is waiting for it, after a cancellation it
swallowed). nats-py's forced flush (``NatsBus.flush``) drops a ``CancelledError`` outright. The
job runner's loop is such a loop too: a swallowed cancellation left a master deciding after its
service had closed (in 7 runs of 26 of one test, here). The status bucket (``KvStore``) checks
too, after each write and read: one whose reply swallowed the caller's cancellation raises it
(the write may have landed, as with any cancelled write). Aegis' own timed waits use
``asyncio.timeout``, which keeps both kinds of cancellation apart in 3.11. nats-py's connect
retries for ever and checks nothing: it is awaited through ``cancellable``, which ends the
caller's wait at its cancellation whatever the connect does with its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aegis.adapters.ports import Bus

T = TypeVar("T")

log = logging.getLogger(__name__)

RECANCEL_S = 0.5  # how often ``cancellable`` cancels again a task that swallowed a cancellation


def cancellations() -> int:
    """The current task's count of cancellation requests not yet withdrawn."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def raise_if_cancelled(since: int = 0) -> None:
    """Raise ``CancelledError`` if the current task was cancelled (more often than ``since``,
    the count when the loop began) and something swallowed it."""
    if cancellations() > since:
        raise asyncio.CancelledError


async def sleep_or_done(done: asyncio.Event, delay_s: float) -> None:
    """Sleep ``delay_s``, or less once ``done`` is set. ``asyncio.timeout``, not ``wait_for``:
    3.11's ``wait_for`` turns a cancellation that meets its own timeout into ``TimeoutError``,
    which this would take for the end of a sleep."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay_s):
            await done.wait()


async def answers(bus: Bus, timeout_s: float) -> bool:
    """Whether ``bus`` answers a round trip (a flush) within ``timeout_s``: a hung server, or a
    partition between this process and it, looks connected for minutes (nats-py pings every two
    minutes). A cancellation the flush swallowed is raised again."""
    since = cancellations()
    try:
        await bus.flush(timeout_s=timeout_s)
    except Exception:  # whatever the failure, the bus did not answer
        raise_if_cancelled(since)
        return False
    raise_if_cancelled(since)
    return True


async def to_thread_to_its_end(fn: Callable[[], T]) -> T:
    """``asyncio.to_thread(fn)``, but a cancellation is raised only once ``fn`` has ended: what
    ``fn`` started (a NATS server) is then there for the caller's clean-up to stop, not started
    in its thread after the clean-up ran (its directory, with the operator's keys, left)."""
    task = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError as cancelled:
        await _until_ended(task, recancel=False)  # a thread is not cancelled: it ends
        if not task.cancelled():
            task.exception()  # retrieved: the cancellation is what the caller hears
        raise cancelled from None


async def cancellable(work: Coroutine[Any, Any, T], discard: Callable[[T], Awaitable[object]]) -> T:
    """``await work``, except that a cancellation of the caller always ends the wait: ``work``
    runs in a task of its own, awaited through ``asyncio.shield``. On the caller's cancellation
    that task is cancelled every :data:`RECANCEL_S` until it has ended (3.11's ``wait_for``
    inside it may swallow each one: nats-py's connect went on retrying a server that never
    answered, and ``aegis run`` was deaf to its SIGTERM), and what it made all the same goes
    to ``discard`` (a client to close), to its end. Then the cancellation is raised, whatever
    ``discard`` raised (logged)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError as cancelled:
        await _until_ended(task, recancel=True)
        if not task.cancelled() and task.exception() is None:
            discarding = asyncio.ensure_future(discard(task.result()))
            await _until_ended(discarding, recancel=False)  # (a second cancellation waits)
            if not discarding.cancelled() and (failed := discarding.exception()) is not None:
                log.warning("discarding what a cancelled task made failed: %r", failed)
        raise cancelled from None


async def _until_ended(task: asyncio.Future[T], *, recancel: bool) -> None:
    """Until ``task`` has ended, whatever cancels the caller meanwhile (the caller's clean-up
    needs it ended); ``recancel``: cancel it each :data:`RECANCEL_S` meanwhile."""
    while not task.done():
        if recancel:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([task], timeout=RECANCEL_S if recancel else None)


async def until_set_or_failed(done: asyncio.Event, task: asyncio.Task[None] | None) -> bool:
    """Until ``done`` is set or ``task`` (None: none) ended; whether ``done`` was set."""
    waiting: set[asyncio.Future[object]] = {asyncio.ensure_future(done.wait())}
    if task is not None:
        waiting.add(task)  # type: ignore[arg-type]
    _, pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    for waiter in pending - {task}:  # the event's waiter, never the task
        waiter.cancel()
    return done.is_set()
