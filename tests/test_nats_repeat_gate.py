"""A client retrying an unreachable NATS server every 0.25 s logs the failure once, then once
every 30 s with how many it held back (a master started before its server logged 240 lines a
minute); every error still reaches ``on_error``. A server's URL in a message shows no
credentials."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_text import RepeatGate, shown
from aegis.spawn.ports import free_port
from tests.waits import async_wait_until


def test_equal_lines_are_said_once_a_period_with_the_count_held_back() -> None:
    gate = RepeatGate(every_s=30.0)
    assert gate.say("refused", 0.0) == "refused"
    assert [gate.say("refused", t) for t in (0.25, 0.5, 29.9)] == [None, None, None]
    assert gate.say("other", 1.0) == "other"  # another line is its own
    assert gate.say("refused", 30.0) == "refused (and 3 more times in the last 30 s)"
    assert gate.say("refused", 61.0) == "refused"  # none held back since


def test_the_lines_remembered_are_bounded() -> None:
    gate = RepeatGate(every_s=30.0)
    for n in range(RepeatGate.KEPT + 10):
        assert gate.say(f"line {n}", 0.0) == f"line {n}"
    assert gate.say("line 0", 1.0) == "line 0"  # forgotten past KEPT: said again, not held


async def test_a_client_retrying_a_dead_server_logs_its_failure_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    errors: list[Exception] = []
    caplog.set_level(logging.WARNING, logger="aegis.adapters.nats_bus")
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    connecting = asyncio.create_task(
        NatsBus.connect(url, name="early", on_error=errors.append, connect_timeout_s=1.0)
    )
    try:
        await async_wait_until(lambda: len(errors) >= 6, 60, "six failed tries",
                               seen=lambda: len(errors))  # fmt: skip
    finally:
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await connecting
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nats early:")]
    assert len(said) == 1, said  # (each of the six before)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://user:secret@h:1,nats://h2:2", "nats://***@h:1,nats://h2:2"),
        ("tls://a-token@h:4222", "tls://***@h:4222"),
        ("user:secret@h:4222", "nats://***@h:4222"),  # no scheme: nats:// (as connected)
        ("tok@h:4222", "nats://***@h:4222"),
        ("h:4222", "nats://h:4222"),
    ],
)
def test_a_url_in_a_message_shows_no_credentials(url: str, said: str) -> None:
    assert shown(url) == said
