"""Whether a job's creator on another host or container still leads it (``master.ping``): on a
bus, a ``ping`` answered only by the master service leading the job, and its pods' reports.
Only a yes counts; a bus that is down is "cannot tell", never "gone"."""

from __future__ import annotations

import msgspec
import pytest

from aegis.adapters.memory import MemoryBus
from aegis.adapters.ports import Handler, Subscription
from aegis.master import control, ping
from aegis.master.control_file import CONTROL_SUBJECT

WINDOW_S = 0.3  # the whole ask, where nothing answers (no answer is awaited against it)
LONG_S = 120.0  # where an answer comes: never reached


async def _led(
    bus: MemoryBus, window_s: float = LONG_S, every_s: float = 1.0, creation: str = ""
) -> str | None:
    return await ping.still_led(bus, "default", "same", inbox_prefix="_I", window_s=window_s,
                                every_s=every_s, creation=creation)  # fmt: skip


def _answering(bus: MemoryBus, ok: bool, after: int = 1) -> tuple[Handler, list[bytes]]:
    """A handler of pings that answers ``ok`` from the ``after``-th one on."""
    seen: list[bytes] = []

    async def answer(_: str, payload: bytes) -> None:
        seen.append(payload)
        if len(seen) >= after:
            asked = msgspec.json.decode(payload, type=control.ControlRequest)
            said = msgspec.json.encode(control.ControlReply(ok, "says"))
            await bus.publish(asked.reply_to, said)

    return answer, seen


async def test_the_master_service_answers_only_for_the_jobs_it_leads() -> None:
    bus = MemoryBus()
    served = await ping.serve(bus, lambda ns, job: object() if job == "same" else None)
    assert await _led(bus) == ping.ANSWERED
    assert await ping.still_led(bus, "default", "other", inbox_prefix="_I",
                                window_s=WINDOW_S) is None  # fmt: skip
    await served.unsubscribe()
    assert bus.handlers == {}  # every subscription of the asks ended


async def test_a_ping_is_sent_again_until_answered() -> None:
    """NATS core delivers at most once: a ping lost on the way (here: the first, unanswered)
    is sent again, so a live master is not judged gone for one lost message."""
    bus = MemoryBus()
    handler, seen = _answering(bus, True, after=2)
    sub = await bus.subscribe(CONTROL_SUBJECT, handler)
    assert await _led(bus, every_s=0.05) == ping.ANSWERED
    assert len(seen) == 2 and len(set(seen)) == 1  # the same request, to the same inbox
    await sub.unsubscribe()


async def test_a_no_counts_for_nothing() -> None:
    """Anyone may answer first on a server without auth: a "no" frees no live job's name; the
    ask goes on, and a yes after it still keeps the name."""
    bus = MemoryBus()
    handler, _ = _answering(bus, False)
    sub = await bus.subscribe(CONTROL_SUBJECT, handler)
    assert await _led(bus, WINDOW_S, every_s=0.05) is None
    yes, _ = _answering(bus, True, after=3)
    late = await bus.subscribe(CONTROL_SUBJECT, yes)
    assert await _led(bus, every_s=0.05) == ping.ANSWERED
    await sub.unsubscribe()
    await late.unsubscribe()


async def test_a_pod_that_reports_keeps_the_name() -> None:
    """No master answers (an older version's does not know ping), but the job's pods report:
    it is led. A master's answer in the same second says more, and is what is said."""
    bus = MemoryBus()

    async def report(_: str, payload: bytes) -> None:
        await bus.publish("aegis.default.same.worker.same-0", b"{}")

    sub = await bus.subscribe(CONTROL_SUBJECT, report)
    assert await _led(bus) == ping.REPORTING
    await sub.unsubscribe()
    other = await bus.subscribe(CONTROL_SUBJECT, lambda s, p: bus.publish(
        "aegis.default.other.worker.other-0", b"{}"))  # fmt: skip
    assert await _led(bus, WINDOW_S) is None  # another job's pods say nothing of this one
    await other.unsubscribe()
    both = await bus.subscribe(CONTROL_SUBJECT, report)
    served = await ping.serve(bus, lambda ns, job: object())
    assert await _led(bus) == ping.ANSWERED
    await both.unsubscribe()
    await served.unsubscribe()


async def test_the_pods_of_the_records_creation_keep_the_name() -> None:
    """The pods of an ``aegis run``'s job report on its creation's subjects: heard there, they
    keep the name; a report on the name's subjects of another creation says nothing of it."""
    bus = MemoryBus()

    def reporting_on(subject: str) -> Handler:
        async def report(_: str, payload: bytes) -> None:
            await bus.publish(subject, b"{}")

        return report

    sub = await bus.subscribe(
        CONTROL_SUBJECT, reporting_on("aegis.default.same.0a1b2c3d.worker.same-0")
    )
    assert await _led(bus, creation="0a1b2c3d") == ping.REPORTING
    assert await _led(bus, WINDOW_S) is None  # a record without the id: not its pods
    assert await _led(bus, WINDOW_S, creation="99999999") is None
    await sub.unsubscribe()


@pytest.mark.parametrize("how", ["disconnected", "refused", "lost", "hung", "closed"])
async def test_a_master_that_cannot_ask_cannot_tell(how: str) -> None:
    """Down at the first look, a publish refused, the link lost in the middle of the window, a
    link that carries no round trip at the end (it looks connected), a closed connection that
    takes no subscription: never "gone"."""
    bus = MemoryBus()
    if how == "disconnected":
        bus.connected = False
    elif how == "refused":

        async def refuse(subject: str, payload: bytes) -> None:
            raise OSError("the server refused")

        bus.publish = refuse  # type: ignore[method-assign]
    elif how == "lost":

        async def lose_the_link(subject: str, payload: bytes) -> None:
            bus.connected = False

        await bus.subscribe(CONTROL_SUBJECT, lose_the_link)
    elif how == "hung":

        async def no_round_trip(timeout_s: float = 5.0) -> None:
            raise TimeoutError

        bus.flush = no_round_trip  # type: ignore[method-assign]
    else:

        async def closed(subject: str, handler: Handler) -> Subscription:
            raise ConnectionError("the connection is closed")

        bus.subscribe = closed  # type: ignore[method-assign]
    assert await _led(bus, WINDOW_S, every_s=0.05) == ping.UNTOLD
    if how != "lost":
        assert bus.handlers == {}
