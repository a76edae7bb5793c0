"""Cancellation that survives Python 3.11's ``asyncio.wait_for``.

In 3.11, ``wait_for`` returns the inner result when a cancellation arrives just as the inner
future completes, and turns a cancellation that arrives while it is cancelling a timed-out inner
future into ``TimeoutError`` (both fixed in 3.12). nats-py waits for every reply with
``wait_for``, so a loop that retries on errors (polling the status bucket, renewing the lease)
can lose the one cancellation meant to stop it, and run forever: a CI run hung 90 s in a test's
teardown that way. Such loops call ``raise_if_cancelled`` each time round: the task still
remembers that it was asked to stop (``Task.cancelling``).
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` if the current task was cancelled and something swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
