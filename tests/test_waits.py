"""The tests' one way to wait (tests/waits.py): it returns what held, and past its deadline says
what it waited for and what it last saw."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests import waits


def test_wait_until_returns_the_first_true_value() -> None:
    counter = itertools.count()
    assert waits.wait_until(lambda: next(counter) >= 3 and "three", what="three") == "three"


def test_wait_until_names_what_it_waited_for_and_the_last_value_seen() -> None:
    with pytest.raises(AssertionError) as caught:
        waits.wait_until(lambda: [], 0.05, "a non-empty list")
    assert str(caught.value) == "timed out after 0.05 s waiting for a non-empty list; last seen: []"


def test_without_a_name_the_condition_s_source_line_names_it_and_seen_shows_the_state() -> None:
    state = {"step": 4}
    with pytest.raises(waits.WaitTimedOut) as caught:
        waits.wait_until(lambda: state["step"] == 5, 0.05, seen=lambda: state)
    message = str(caught.value)
    assert 'lambda: state["step"] == 5' in message and message.endswith("last seen: {'step': 4}")


async def test_async_wait_until_takes_a_plain_or_an_async_condition() -> None:
    ready = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, ready.set)
    assert await waits.async_wait_until(ready.is_set, what="the event") is True
    looks = itertools.count()

    async def third_look() -> int:
        return next(looks) if next(looks) >= 4 else 0

    assert await waits.async_wait_until(third_look, what="the third look") == 5


async def test_async_wait_until_fails_on_an_async_condition_that_does_not_return() -> None:
    async def never() -> bool:
        await asyncio.Event().wait()
        return True

    with pytest.raises(
        waits.WaitTimedOut,
        match=r"waiting for never; last seen: \(the condition had not returned\)",
    ):
        await waits.async_wait_until(never, 0.05, "never")


async def test_a_timeout_of_the_condition_itself_is_its_own_error() -> None:
    async def times_out() -> bool:
        raise TimeoutError("the condition's own")

    with pytest.raises(TimeoutError, match="the condition's own"):
        await waits.async_wait_until(times_out, 30, "its own timeout")
