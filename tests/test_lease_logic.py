"""The election's logic (``master.lease.Lease``) on the in-memory lease store and a clock the
test moves: who leads, when a leader stops believing it leads, and who follows."""

from __future__ import annotations

import asyncio
import time

import pytest

from aegis.adapters.memory import MemoryLeaseStore
from aegis.master.lease import Lease, LeaseSettings, holder_name, lease_clock


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SETTINGS = LeaseSettings(lease_s=2.0, margin_s=0.3)


def pair() -> tuple[Clock, MemoryLeaseStore, Lease, Lease]:
    clock = Clock()
    store = MemoryLeaseStore(clock)
    return clock, store, Lease(store, "m1", SETTINGS, clock), Lease(store, "m2", SETTINGS, clock)


async def test_one_candidate_leads_and_the_other_waits() -> None:
    _, store, first, second = pair()
    assert await first.try_acquire()
    assert not await second.try_acquire()
    assert first.held and not second.held
    assert first.epoch == store.revision and store.held_by == first.token


async def test_a_leader_stopped_past_its_lease_finds_it_lost_before_writing() -> None:
    clock, store, first, second = pair()
    assert await first.try_acquire()
    epoch = first.epoch
    clock.now += SETTINGS.lease_s - SETTINGS.margin_s  # stopped (SIGSTOP) this long
    assert not first.held  # by its own clock, before the store says so
    writes = store.revision
    assert not await first.renew()
    assert first.epoch is None and store.revision == writes  # nothing written
    clock.now += SETTINGS.margin_s  # the store's TTL passes too
    assert await second.try_acquire()
    assert second.epoch is not None and epoch is not None and second.epoch > epoch


async def test_renewals_keep_the_lead_as_time_passes() -> None:
    clock, _, first, second = pair()
    assert await first.try_acquire()
    for _ in range(10):
        clock.now += 1.0  # within the lease every time
        assert await first.renew()
        assert not await second.try_acquire()
    assert first.held


async def test_a_renewal_that_fails_keeps_the_lease_until_it_runs_out() -> None:
    clock, store, first, _ = pair()
    assert await first.try_acquire()

    async def broken(*args: object, **kwargs: object) -> int:
        raise ConnectionError("stream leader election")

    store.write = broken  # type: ignore[method-assign]
    clock.now += 0.5
    assert await first.renew() and first.renew_failures == 1  # still within the lease
    clock.now += SETTINGS.lease_s
    assert not await first.renew() and first.epoch is None


def lose_the_next_answer(store: MemoryLeaseStore) -> None:
    """The next write takes effect, but its answer never comes back (a timeout while a cluster
    elects a stream leader)."""
    real = store.write

    async def write(holder: str, *, expected: int, ttl_s: float, timeout_s: float) -> int:
        store.write = real  # type: ignore[method-assign]
        await real(holder, expected=expected, ttl_s=ttl_s, timeout_s=timeout_s)
        raise TimeoutError("the answer was lost")

    store.write = write  # type: ignore[method-assign]


async def test_a_renewal_whose_answer_was_lost_does_not_end_the_lead() -> None:
    """The next renewal finds the key moved on, but to this holder's own write: it renews over
    that, rather than ending the lead (and every job's loop) for nothing."""
    clock, store, first, second = pair()
    assert await first.try_acquire()
    epoch = first.epoch
    lose_the_next_answer(store)
    clock.now += 0.5
    assert await first.renew() and first.renew_failures == 1  # unknown outcome: a failure
    assert store.held_by == first.token and store.revision == epoch + 1  # but it took effect
    clock.now += 0.5
    assert await first.renew()
    assert first.epoch == epoch and first.renew_failures == 0 and store.revision == epoch + 2
    clock.now += 1.0  # past the first lease: the latest renewal holds it
    assert first.held and not await second.try_acquire()


async def test_an_acquisition_whose_answer_was_lost_is_taken_up_on_the_next_try() -> None:
    clock, store, first, second = pair()
    lose_the_next_answer(store)
    assert not await first.try_acquire() and first.epoch is None
    assert store.held_by == first.token  # written all the same: nobody else can lead for a TTL
    assert not await second.try_acquire()
    clock.now += 0.2
    assert await first.try_acquire()  # its own name on the key: not a lease to wait out
    assert first.epoch == store.revision and first.held


async def test_a_second_lease_of_the_same_name_never_takes_the_first_ones_key() -> None:
    """Two replicas given one name (a restarted container keeps its host name and PID): the
    second finds the name on the key but not its own write, and waits as any standby."""
    clock, store, first, _ = pair()
    twin = Lease(store, "m1", SETTINGS, clock)
    assert await first.try_acquire()
    assert not await twin.try_acquire()
    lose_the_next_answer(store)
    clock.now += 0.5
    await first.renew()
    assert not await twin.try_acquire() and twin.epoch is None
    assert await first.renew() and first.held


async def test_a_standby_takes_over_at_once_when_the_leader_releases() -> None:
    _, _, first, second = pair()
    assert await first.try_acquire()
    waiting = asyncio.create_task(second.wait_for_lead())
    await asyncio.sleep(0)  # let the standby try once and wait
    assert not waiting.done()
    await first.release()
    async with asyncio.timeout(5):  # the fake clock never moves: only the removal wakes it
        epoch = await waiting
    assert epoch == second.epoch and second.held and first.epoch is None


async def test_a_release_after_a_renewal_whose_answer_was_lost_frees_the_key_at_once() -> None:
    """The leader's last write took effect unanswered, so the key is at a revision it never
    heard of: a clean shutdown still removes it (the key carries its own token), and a standby
    leads without waiting out the TTL."""
    clock, store, first, second = pair()
    assert await first.try_acquire()
    epoch = store.revision
    lose_the_next_answer(store)
    clock.now += 0.5
    await first.renew()
    assert store.held_by == first.token and store.revision == epoch + 1
    await first.release()
    assert store.held_by is None and first.epoch is None
    assert await second.try_acquire()  # the fake clock has not passed the TTL


async def test_a_renewal_refused_because_another_holder_wrote_loses_the_lead_at_once() -> None:
    """Someone else wrote the key (it was freed under this leader): no waiting out the clock."""
    _, store, first, second = pair()
    assert await first.try_acquire()
    await store.remove(expected=store.revision)  # freed behind the leader's back
    assert await second.try_acquire()
    assert first.held  # by its own clock, still
    assert not await first.renew()
    assert first.epoch is None and not first.held and second.held


async def test_a_deposed_leader_that_releases_later_leaves_its_successor_alone() -> None:
    """A leader past its lease keeps an old epoch until it notices; its clean shutdown then
    must not remove the lease its successor holds (a third replica would lead beside it)."""
    clock, store, first, second = pair()
    third = Lease(store, "m3", SETTINGS, clock)
    assert await first.try_acquire()
    clock.now += SETTINGS.lease_s  # stopped past its lease and the store's TTL
    assert await second.try_acquire()
    await first.release()  # its epoch was never cleared: a stale one
    assert store.held_by == second.token and first.epoch is None
    assert not await third.try_acquire()
    assert await second.renew() and second.held


def test_a_lease_is_judged_by_a_clock_that_counts_a_suspended_machines_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``time.monotonic`` stops while a machine is suspended: a leader resumed past its lease
    believed it until its next renewal was refused. ``CLOCK_BOOTTIME`` goes on."""
    lease = Lease(MemoryLeaseStore(), "m1", SETTINGS)
    assert lease.clock is lease_clock
    asked: list[int] = []

    def clock_gettime(clock_id: int) -> float:
        asked.append(clock_id)
        return 7.0

    monkeypatch.setattr(time, "clock_gettime", clock_gettime)
    assert lease.clock() == 7.0 and asked == [time.CLOCK_BOOTTIME]


def test_the_leases_value_names_its_holder_with_a_token_of_its_lease() -> None:
    """What readers of the key (``ReplicatedRun.leader``) take the name from: an older
    replica's value is the name alone."""
    _, store, first, _ = pair()
    assert holder_name(first.token) == "m1" and first.token != "m1"
    assert holder_name("master-1") == "master-1"
    assert holder_name("master-1#0a1b") == "master-1"
    assert store.held_by is None
