"""Retry loops stop when cancelled, even when a NATS call swallowed the cancellation.

Python 3.11's ``asyncio.wait_for`` (which nats-py uses for every reply) can return a result, or
raise ``TimeoutError``, in place of the ``CancelledError`` meant to stop the caller. A loop that
retries on errors then outlives its cancellation: a CI run hung 90 s in the teardown of
tests/test_k8s_master.py, the replica still polling the status bucket. Here each loop's I/O is
replaced by a call that swallows a cancellation exactly as ``wait_for`` does, and the loop must
still end, cancelled, within a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest

from aegis.adapters.aio import cancellable, raise_if_cancelled
from aegis.adapters.memory import MemoryLeaseStore
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.master.lease import Lease, LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.platforms.kubernetes import master_side

NO_RESULT = object()


class Swallower:
    """An awaitable I/O call that swallows a cancellation as 3.11's wait_for does: it returns
    ``result`` (the cancellation arrived as the reply did) or, without one, raises
    ``TimeoutError`` (it arrived while a timed-out call was being cancelled)."""

    def __init__(self, result: object = NO_RESULT) -> None:
        self.result = result
        self.calls = 0
        self.called = asyncio.Event()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.called.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.result is NO_RESULT:
                raise TimeoutError from None
            return self.result
        raise AssertionError("unreachable")


async def stops_when_cancelled(loop: Any, swallower: Swallower) -> None:
    task = asyncio.ensure_future(loop)
    async with asyncio.timeout(10):
        await swallower.called.wait()
    task.cancel()
    # asyncio.wait, not await: awaiting would pass our own timeout's cancellation on to the task
    # (swallowed again); a loop that outlived its cancellation is killed for good below.
    done, _ = await asyncio.wait({task}, timeout=10)
    if not done:
        task.get_coro().close()  # type: ignore[union-attr]
        raise AssertionError(f"the loop went on after its cancellation ({swallower.calls} calls)")
    assert task.cancelled()
    assert swallower.calls == 1  # it did not go round again


async def test_raise_if_cancelled_raises_only_after_a_swallowed_cancellation() -> None:
    raise_if_cancelled()  # not cancelled: nothing happens
    swallower = Swallower()

    async def body() -> str:
        with pytest.raises(TimeoutError):
            await swallower()
        raise_if_cancelled()
        return "went on"

    await stops_when_cancelled(body(), swallower)


async def test_the_replicas_job_poll_and_record_refresh_stop_when_cancelled() -> None:
    for loop_name in ("_poll_jobs", "_refresh_records"):
        replica = Replica(None, "nats://127.0.0.1:1", ReplicaSettings("r1", poll_s=0.01))
        swallower = Swallower()
        replica.store = type("Store", (), {"keys": swallower})()  # type: ignore[assignment]
        loop = getattr(replica, loop_name)
        await stops_when_cancelled(loop(1) if loop_name == "_poll_jobs" else loop(), swallower)


async def test_the_lease_keeper_and_election_stop_when_cancelled() -> None:
    lease = Lease(MemoryLeaseStore(), "r1", LeaseSettings(lease_s=2.0))
    lease.settings = LeaseSettings(lease_s=2.0, renew_s=0.01)
    renewal = Swallower(result=True)  # renewed, says the reply that beat the cancellation
    lease.renew = renewal  # type: ignore[method-assign]
    await stops_when_cancelled(lease.keep(), renewal)

    election = Swallower(result=False)  # someone else holds it
    lease.try_acquire = election  # type: ignore[method-assign]
    await stops_when_cancelled(lease.wait_for_lead(), election)


async def test_the_kubernetes_sides_sync_loop_stops_when_cancelled() -> None:
    side = master_side.KubernetesSide(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        master_side.KubernetesSettings(poll_s=0.01),
    )
    swallower = Swallower()
    side.sync_once = swallower  # type: ignore[method-assign]
    await stops_when_cancelled(side.run(), swallower)


async def test_a_won_election_still_stops_when_the_cancellation_was_swallowed() -> None:
    lease = Lease(MemoryLeaseStore(), "r1", LeaseSettings(lease_s=2.0))
    won = Swallower(result=True)  # the reply that beat the cancellation: acquired
    lease.try_acquire = won  # type: ignore[method-assign]
    await stops_when_cancelled(lease.wait_for_lead(), won)


async def test_a_cancellation_left_over_from_before_the_loop_does_not_stop_it() -> None:
    """3.11's TaskGroup can leave a count behind (a child failing after it swallowed its own
    cancellation): a standby must still wait for the lease, not quit."""

    async def standby() -> int:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)  # the cancellation lands here and is absorbed
        assert task.cancelling() == 1  # ... but never withdrawn
        lease = Lease(MemoryLeaseStore(), "r1", LeaseSettings(lease_s=2.0))
        answers = iter([False, False, True])

        async def try_acquire() -> bool:
            return next(answers)

        async def wait_vacancy(timeout_s: float) -> None:
            await asyncio.sleep(0)

        lease.try_acquire = try_acquire  # type: ignore[method-assign]
        lease.store.wait_vacancy = wait_vacancy  # type: ignore[method-assign]
        lease.epoch = 7
        return await lease.wait_for_lead()

    assert await asyncio.wait_for(asyncio.ensure_future(standby()), 10) == 7


async def test_a_store_call_whose_reply_swallowed_the_cancellation_raises_it(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """The write landed (or the read came back) as the caller was cancelled: the status bucket
    raises the cancellation all the same, as asyncio would had nats-py not swallowed it, so no
    caller goes on as if it had not been cancelled (the job loop once did)."""
    bus = await NatsBus.connect(nats_server.url, authority.master_creds())
    try:
        kv = await bus.client.jetstream().create_key_value(bucket="swallowed", history=1)
        store = KvStore(kv, client=bus.client)  # the bucket whose replies we swallow
        revision = await store.put("k", b"v1", expected_revision=None)
        for verb, call, result in (
            ("update", store.put("k", b"v2", expected_revision=revision), revision + 1),
            ("create", store.put("new", b"v", expected_revision=None), revision + 2),
            ("get", store.get("k"), await kv.get("k")),  # type: ignore[attr-defined]
        ):
            swallower = Swallower(result=result)
            setattr(kv, verb, swallower)
            await stops_when_cancelled(call, swallower)
    finally:
        await bus.close()


async def test_a_connect_that_swallowed_its_cancellation_still_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nats-py's connect retries for ever a server that takes the connection and never speaks,
    and waits for each TCP connection with 3.11's ``wait_for``. A cancellation that arrived as
    a connection was made was lost, and the connect went on: in CI an ``aegis run --nats`` at
    such a socket did not end in the 120 s after its SIGTERM. Here the cancellation arrives
    exactly then, twice (the second for the retry of it); the connect must end, cancelled,
    and leave no task behind."""
    real = asyncio.open_connection
    victims: list[asyncio.Future[NatsBus]] = []

    async def open_then_cancel(*args: Any, **kwargs: Any) -> Any:
        made = await real(*args, **kwargs)
        for victim in victims:
            victim.cancel()  # as the reply came: wait_for returns it, and the cancel is lost
        victims.clear()
        return made

    monkeypatch.setattr(asyncio, "open_connection", open_then_cancel)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        connecting = asyncio.ensure_future(NatsBus.connect(url, connect_timeout_s=0.2))
        victims.append(connecting)
        done, _ = await asyncio.wait({connecting}, timeout=30)
        if not done:
            connecting.get_coro().close()  # type: ignore[union-attr]
            raise AssertionError("the connect went on after its cancellation")
    assert connecting.cancelled()
    assert not victims  # the cancellation came as the connection was made
    assert asyncio.all_tasks() == {asyncio.current_task()}  # the retry loop ended too


async def test_cancellable_cancels_until_the_work_ends_and_discards_what_it_made() -> None:
    """The work swallows the first cancellations (a result ready as each arrived) and makes its
    result all the same: the caller hears its cancellation at once, and the result is discarded."""
    swallowed, discarded = [], []
    started = asyncio.Event()

    async def work() -> str:
        started.set()
        while len(swallowed) < 2:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
                raise AssertionError("never cancelled")
            swallowed.append("one")
        return "client"

    async def discard(made: str) -> None:
        discarded.append(made)

    caller = asyncio.ensure_future(cancellable(work(), discard))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 30)
    assert (swallowed, discarded) == (["one", "one"], ["client"])
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_cancellable_discards_to_the_end_and_still_raises_the_cancellation() -> None:
    """What the work made is discarded to the end, even when the caller is cancelled again
    meanwhile (a client's close cut short left its socket open); a ``discard`` that fails is
    logged, and the caller still hears its cancellation (it heard the close's error)."""
    started, closing, release, closed = asyncio.Event(), asyncio.Event(), asyncio.Event(), []

    async def work() -> str:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # the first cancellation: swallowed, as a reply came
        return "client"

    async def discard(made: str) -> None:
        closing.set()
        await release.wait()
        closed.append(made)
        raise ConnectionResetError("the server went first")

    caller = asyncio.ensure_future(cancellable(work(), discard))
    async with asyncio.timeout(30):
        await started.wait()
    caller.cancel()
    async with asyncio.timeout(30):
        await closing.wait()
    caller.cancel()  # again, while it closes what was made
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 30)
    assert closed == ["client"]
