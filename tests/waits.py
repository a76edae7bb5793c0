"""Waiting in tests: until a condition holds, with a deadline, never a bare sleep.

``wait_until`` (in a thread or a plain test) and ``async_wait_until`` (in a coroutine; the
condition may be a plain or an async function) poll ``condition`` until it returns something
true, and return that. Past the deadline they fail the test with what was awaited (``what``, or
the condition's source line) and what was last seen (the condition's last value, or
``seen()`` when given). The deadlines are generous: a loaded 2-core machine is slow, and a test
gets its tolerance from waiting on a condition, never from a weaker assertion; a condition that
holds costs no wait at all.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")

DEFAULT_S = 60.0  # a condition that takes long on a loaded machine still holds well before it
POLL_S = 0.01
IO_POLL_S = 0.05  # an async condition: each look is I/O (a request, a status read)


class WaitTimedOut(AssertionError):
    """A condition did not hold before its deadline (an ``AssertionError``: the test fails)."""


def wait_until(
    condition: Callable[[], T],
    timeout_s: float = DEFAULT_S,
    what: str = "",
    *,
    seen: Callable[[], object] | None = None,
    poll_s: float = POLL_S,
) -> T:
    """Poll ``condition`` until it returns something true, and return that (``poll_s``: longer
    for a condition that reads much, so the looking does not load the machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(condition, timeout_s, what, _last(seen, value))
        time.sleep(poll_s)


@overload
async def async_wait_until(
    condition: Callable[[], Awaitable[T]],
    timeout_s: float = ...,
    what: str = ...,
    *,
    seen: Callable[[], object] | None = ...,
) -> T: ...


@overload
async def async_wait_until(
    condition: Callable[[], T],
    timeout_s: float = ...,
    what: str = ...,
    *,
    seen: Callable[[], object] | None = ...,
) -> T: ...


async def async_wait_until(
    condition: Callable[[], object],
    timeout_s: float = DEFAULT_S,
    what: str = "",
    *,
    seen: Callable[[], object] | None = None,
) -> object:
    """Poll ``condition`` (plain or async) until it returns something true, and return that.
    An async condition that does not return by the deadline fails the same way."""
    deadline = time.monotonic() + timeout_s
    value: object = None
    while True:
        value = condition()
        poll_s = POLL_S
        if inspect.isawaitable(value):
            poll_s = IO_POLL_S
            scope = asyncio.timeout(max(deadline - time.monotonic(), 0.0))
            try:
                async with scope:
                    value = await value
            except TimeoutError:
                if not scope.expired():
                    raise  # the condition's own timeout, not the deadline
                last = _last(seen, None) if seen is not None else "(the condition had not returned)"
                raise _timed_out(condition, timeout_s, what, last) from None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(condition, timeout_s, what, _last(seen, value))
        await asyncio.sleep(poll_s)


def _last(seen: Callable[[], object] | None, value: object) -> str:
    return repr(seen() if seen is not None else value)


def _timed_out(
    condition: Callable[[], object], timeout_s: float, what: str, last: str
) -> WaitTimedOut:
    return WaitTimedOut(
        f"timed out after {timeout_s} s waiting for {what or _describe(condition)}; "
        f"last seen: {last}"
    )


def _describe(condition: Callable[[], object]) -> str:
    """The condition's source line (a lambda's is the call's), or its name."""
    try:
        return inspect.getsource(condition).strip()
    except (OSError, TypeError):
        return getattr(condition, "__qualname__", repr(condition))
