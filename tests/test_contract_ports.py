"""One contract suite for each port, run against the real adapter and the in-memory fake."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_lease import NatsLeaseStore
from aegis.adapters.nats_server import EmbeddedNats
from aegis.adapters.ports import Bus, LeaseStore, LeaseTakenError, StatusStore, StoreConflictError
from tests.waits import async_wait_until


@pytest.fixture(params=["nats", "memory"])
async def bus(request: pytest.FixtureRequest, authority: Authority) -> AsyncIterator[Bus]:
    if request.param == "memory":
        yield memory.MemoryBus()
        return
    server = request.getfixturevalue("nats_server")
    assert isinstance(server, EmbeddedNats)
    real = await NatsBus.connect(server.url, authority.master_creds())
    yield real
    await real.close()


@pytest.fixture(params=["nats", "memory"])
async def two_buses(
    request: pytest.FixtureRequest, authority: Authority
) -> AsyncIterator[tuple[Bus, Bus]]:
    """Two clients of one bus (NATS: two connections to one server)."""
    if request.param == "memory":
        shared = memory.MemoryBus()
        yield shared, shared
        return
    server = request.getfixturevalue("nats_server")
    assert isinstance(server, EmbeddedNats)
    first = await NatsBus.connect(server.url, authority.master_creds())
    second = await NatsBus.connect(server.url, authority.master_creds())
    yield first, second
    await first.close()
    await second.close()


@pytest.fixture(params=["jetstream-kv", "memory"])
async def store(request: pytest.FixtureRequest, authority: Authority) -> AsyncIterator[StatusStore]:
    if request.param == "memory":
        yield memory.MemoryStore()
        return
    server = request.getfixturevalue("nats_server")
    real = await NatsBus.connect(server.url, authority.master_creds())
    yield await KvStore.open(real, "contract")
    await real.close()


@pytest.fixture(params=["jetstream-kv", "memory"])
async def lease_store(
    request: pytest.FixtureRequest, authority: Authority
) -> AsyncIterator[LeaseStore]:
    if request.param == "memory":
        yield memory.MemoryLeaseStore()
        return
    server = request.getfixturevalue("nats_server")
    real = await NatsBus.connect(server.url, authority.master_creds())
    store = NatsLeaseStore(
        real.client, bucket="contract-lease", key="leader", replicas=1, ttl_s=1.0
    )
    await store.open()
    yield store
    await store.stop_watching()
    await real.close()


async def test_bus_delivers_to_matching_subscriptions_only(bus: Bus) -> None:
    got: list[tuple[str, bytes]] = []

    async def handler(subject: str, payload: bytes) -> None:
        got.append((subject, payload))

    await bus.subscribe("aegis.ns.job.>", handler)
    await bus.subscribe("aegis.ns.*.worker", handler)
    await bus.publish("aegis.ns.job.worker", b"a")  # both match
    await bus.publish("aegis.ns.other.master", b"b")  # neither
    await bus.publish("aegis.ns.job.master", b"c")  # first only
    await bus.flush()
    await async_wait_until(lambda: len(got) >= 3, what="three deliveries")
    assert sorted(got) == [
        ("aegis.ns.job.master", b"c"),
        ("aegis.ns.job.worker", b"a"),
        ("aegis.ns.job.worker", b"a"),
    ]


async def test_bus_flush_puts_a_new_subscription_in_place_for_every_publisher(
    two_buses: tuple[Bus, Bus],
) -> None:
    """Once ``flush`` returns, what was sent before it has reached the server: a message another
    client publishes right after reaches the new subscription. (nats-py writes its PING ahead of
    the commands still queued for its flusher task, so a bare client flush lost about one
    message in 40 here.) Many rounds, each on a fresh subject, one message each."""
    subscriber, publisher = two_buses
    got: list[str] = []

    async def handler(subject: str, payload: bytes) -> None:
        got.append(subject)

    rounds = [f"aegis.ns.job.round{i}" for i in range(200)]
    for subject in rounds:
        await subscriber.subscribe(subject, handler)
        await subscriber.flush()
        await publisher.publish(subject, b"order")
        await publisher.flush()
    await async_wait_until(
        lambda: len(got) >= len(rounds), what="one delivery per round",
        seen=lambda: sorted(set(rounds) - set(got)),
    )  # fmt: skip
    assert sorted(got) == sorted(rounds)


async def test_bus_says_it_is_connected_until_it_is_closed(bus: Bus) -> None:
    assert bus.connected
    await bus.close()
    assert not bus.connected


async def test_bus_unsubscribe_stops_delivery(bus: Bus) -> None:
    got: list[bytes] = []

    async def handler(subject: str, payload: bytes) -> None:
        got.append(payload)

    sub = await bus.subscribe("x.y", handler)
    await bus.publish("x.y", b"1")
    await bus.flush()
    await async_wait_until(lambda: got == [b"1"], what="first delivery")
    await sub.unsubscribe()
    await bus.publish("x.y", b"2")
    await bus.flush()
    marker: list[bytes] = []

    async def on_marker(subject: str, payload: bytes) -> None:
        marker.append(payload)

    await bus.subscribe("x.marker", on_marker)
    await bus.publish("x.marker", b"m")
    await bus.flush()
    await async_wait_until(lambda: marker == [b"m"], what="marker after unsubscribe")
    assert got == [b"1"]


async def test_store_create_then_revision_checked_update(store: StatusStore) -> None:
    assert await store.get("job.a") is None
    first = await store.put("job.a", b"v1", expected_revision=None)
    assert await store.get("job.a") == (b"v1", first)
    second = await store.put("job.a", b"v2", expected_revision=first)
    assert second > first
    assert await store.get("job.a") == (b"v2", second)


async def test_store_refuses_stale_revision_and_double_create(store: StatusStore) -> None:
    first = await store.put("job.b", b"v1", expected_revision=None)
    await store.put("job.b", b"v2", expected_revision=first)
    with pytest.raises(StoreConflictError):
        await store.put("job.b", b"lost update", expected_revision=first)
    with pytest.raises(StoreConflictError):
        await store.put("job.b", b"again", expected_revision=None)
    value = await store.get("job.b")
    assert value is not None and value[0] == b"v2"


async def test_store_lists_keys(store: StatusStore) -> None:
    assert await store.keys() == []
    await store.put("ns.j1", b"1", expected_revision=None)
    await store.put("ns.j2", b"2", expected_revision=None)
    assert await store.keys() == ["ns.j1", "ns.j2"]


async def test_store_lists_every_key_whatever_it_holds_however_often_asked(
    store: StatusStore,
) -> None:
    await store.put("ns.bad", b"\x00not json", expected_revision=None)  # the reader skips it
    await store.put("ns.job", b"{}", expected_revision=None)
    for _ in range(1_100):  # more calls than nats-server allows a stream consumers (1,000)
        listed = await store.keys()
    assert listed == ["ns.bad", "ns.job"]
    await store.put("ns.after", b"1", expected_revision=None)
    assert await store.keys() == ["ns.after", "ns.bad", "ns.job"]


async def test_store_removes_a_record_at_its_revision_and_leaves_no_trace(
    store: StatusStore,
) -> None:
    first = await store.put("ns.ended", b"v1", expected_revision=None)
    ended = await store.put("ns.ended", b"v2", expected_revision=first)
    await store.put("ns.live", b"1", expected_revision=None)
    assert await store.remove("ns.ended", ended) is True
    assert await store.get("ns.ended") is None
    assert await store.keys() == ["ns.live"]  # no marker listed
    again = await store.put("ns.ended", b"new job", expected_revision=None)  # the name is free
    assert await store.remove("ns.ended", ended) is False  # a newer record is not removed
    assert await store.get("ns.ended") == (b"new job", again)
    assert await store.remove("ns.gone", 5) is True  # nothing there: nothing to keep


async def test_lease_store_lets_one_holder_write_at_a_time(lease_store: LeaseStore) -> None:
    vacant = await lease_store.vacant_revision()
    assert vacant == 0  # never written
    first = await lease_store.write("m1", expected=vacant, ttl_s=30, timeout_s=5)
    assert first > vacant
    with pytest.raises(LeaseTakenError):
        await lease_store.vacant_revision()
    with pytest.raises(LeaseTakenError):  # a second candidate that read the vacancy too late
        await lease_store.write("m2", expected=vacant, ttl_s=30, timeout_s=5)
    renewed = await lease_store.write("m1", expected=first, ttl_s=30, timeout_s=5)
    assert renewed > first
    with pytest.raises(LeaseTakenError):  # a renewal from before the last one: stale
        await lease_store.write("m1", expected=first, ttl_s=30, timeout_s=5)


async def test_lease_store_names_the_live_holder_and_the_revision_it_wrote(
    lease_store: LeaseStore,
) -> None:
    assert await lease_store.holder() is None  # never written
    first = await lease_store.write(
        "m1", expected=await lease_store.vacant_revision(), ttl_s=60, timeout_s=5
    )
    assert await lease_store.holder() == ("m1", first)
    renewed = await lease_store.write("m1", expected=first, ttl_s=60, timeout_s=5)
    assert await lease_store.holder() == ("m1", renewed)
    await lease_store.remove(expected=renewed)
    assert await lease_store.holder() is None  # removed
    taken = await lease_store.write(
        "m2", expected=await lease_store.vacant_revision(), ttl_s=60, timeout_s=5
    )
    assert await lease_store.holder() == ("m2", taken)


async def test_lease_store_frees_the_key_when_its_ttl_passes(lease_store: LeaseStore) -> None:
    held = await lease_store.write(
        "m1", expected=await lease_store.vacant_revision(), ttl_s=1, timeout_s=5
    )

    async def vacant() -> int | None:
        try:
            return await lease_store.vacant_revision()
        except LeaseTakenError:
            return None

    async def expired() -> bool:
        return await vacant() is not None

    await async_wait_until(expired, what="the lease's TTL to pass")
    after = await vacant()
    assert after is not None and after > held  # the expiry takes a revision
    assert await lease_store.holder() is None
    with pytest.raises(LeaseTakenError):  # the old holder's renewal is refused
        await lease_store.write("m1", expected=held, ttl_s=30, timeout_s=5)
    assert await lease_store.write("m2", expected=after, ttl_s=30, timeout_s=5) > after


async def test_lease_store_wakes_a_waiting_standby_when_the_lease_is_removed(
    lease_store: LeaseStore,
) -> None:
    held = await lease_store.write(
        "m1", expected=await lease_store.vacant_revision(), ttl_s=60, timeout_s=5
    )
    await lease_store.wait_vacancy(0.05)  # held: returns at the timeout (and watches the key)
    with pytest.raises(LeaseTakenError):
        await lease_store.vacant_revision()
    waiting = asyncio.create_task(lease_store.wait_vacancy(60))
    await lease_store.remove(expected=held)
    async with asyncio.timeout(15):  # long before the 60-s wait and the TTL
        await waiting
    free = await lease_store.vacant_revision()
    assert await lease_store.write("m2", expected=free, ttl_s=60, timeout_s=5) > free


async def test_lease_store_removes_only_the_lease_its_holder_last_wrote(
    lease_store: LeaseStore,
) -> None:
    """A deposed holder's removal (its revision is an old one) is refused: the successor's
    lease stays, and no third candidate finds the key vacant."""
    old = await lease_store.write(
        "m1", expected=await lease_store.vacant_revision(), ttl_s=60, timeout_s=5
    )
    await lease_store.remove(expected=old)
    successor = await lease_store.write(
        "m2", expected=await lease_store.vacant_revision(), ttl_s=60, timeout_s=5
    )
    with pytest.raises(LeaseTakenError):
        await lease_store.remove(expected=old)
    with pytest.raises(LeaseTakenError):  # still m2's
        await lease_store.vacant_revision()
    assert await lease_store.write("m2", expected=successor, ttl_s=60, timeout_s=5) > successor
