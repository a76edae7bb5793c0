"""A master that serves for days: the leader removes an ended job's record from the status
bucket after ``keep_ended_s`` (so a poll lists the live jobs and the recently ended ones, not
every job ever run), a standby keeps no ended job's record, and a name whose record was removed
can be submitted again (a real nats-server and real replicas)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from aegis.adapters.memory import MemoryStore
from aegis.core import events as ev
from aegis.core.model import JobSpec
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.retention import Ended
from aegis.master.lease import LeaseSettings
from aegis.master.ports import NullPlatform
from aegis.master.replica import Replica, ReplicaSettings
from aegis.platforms.served_job import ServedJob
from tests.poll_helpers import LEASE_S, Master, leads, standalone_master
from tests.waits import async_wait_until

KEEP_S = 1.0


async def _submit(master: Master, name: str) -> ServedJob:
    spec = JobSpec(job=name, namespace="default", worker_num=2, max_retry=1)
    served = await ServedJob.submit(
        master.bus, master.store, spec, ["node-0", "node-1"], NullPlatform()
    )
    await async_wait_until(lambda: leads(master, f"default.{name}"), what=f"{name} adopted")
    return served


async def _end(served: ServedJob) -> None:
    served.server.sink(ev.QuitRequested("over"))

    async def ended() -> bool:
        return (await served.status()).phase in TERMINAL_PHASES

    await async_wait_until(ended, what="the job to end")
    await served.close()


async def _listed(master: Master) -> list[str]:
    return await master.store.keys()


async def test_the_leader_removes_an_ended_jobs_record_after_the_retention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The retention runs on a clock the test moves: on a loaded machine the wall clock passed
    the retention before the standby had seen the job end (the record was gone, never seen
    ended), and the test failed by chance."""
    now = [1000.0]
    async with standalone_master(monkeypatch, poll_s=0.05, keep_ended_s=KEEP_S,
                                 clock=lambda: now[0]) as master:  # fmt: skip
        standby = Replica(None, master.server.url, ReplicaSettings(
            replica_id="m2", lease=LeaseSettings(lease_s=LEASE_S), poll_s=0.05,
            clock=lambda: now[0]))  # fmt: skip
        standby_task = asyncio.create_task(standby.run(), name="standby")
        try:
            ended, live = await _submit(master, "ret-a"), await _submit(master, "ret-b")
            await async_wait_until(
                lambda: {"default.ret-a", "default.ret-b"} <= set(standby.records),
                what="the standby holds both live jobs' records",
            )
            await _end(ended)
            await async_wait_until(
                lambda: "default.ret-a" in master.replica.finished, what="seen ended"
            )
            # the standby drops the ended job's record to its key (its refresh reads it again;
            # while the record says the end is still being carried out, it holds neither)
            await async_wait_until(
                lambda: (
                    "default.ret-a" not in standby.records and "default.ret-a" in standby.finished
                ),
                what="standby filed it ended",
            )
            polls = master.polls.started["jobs"]
            await async_wait_until(lambda: master.polls.started["jobs"] >= polls + 5,
                                   what="5 more polls")  # fmt: skip
            assert await _listed(master) == ["default.ret-a", "default.ret-b"]  # kept a while
            now[0] += KEEP_S  # the retention has passed

            async def removed() -> bool:
                return "default.ret-a" not in await _listed(master)

            await async_wait_until(removed, what="the ended job's record removed")
            # (the leader counts it once the store's answer is back, which can come after the
            # bucket no longer lists the key)
            await async_wait_until(lambda: master.replica.removed == 1, what="counted")
            assert standby.removed == 0
            assert await master.store.get("default.ret-a") is None
            await async_wait_until(
                lambda: "default.ret-a" not in master.replica.finished, what="forgotten"
            )
            await async_wait_until(
                lambda: "default.ret-a" not in standby.finished, what="standby forgot"
            )
            # the live job is untouched; the name is free for a new job, which is adopted
            assert await _listed(master) == ["default.ret-b"]
            assert (await live.status()).phase is not Phase.FAILED
            again = await _submit(master, "ret-a")  # adopted again
            assert (await again.status()).phase not in TERMINAL_PHASES
            assert master.replica.removed == 1
            for served in (live, again):
                await _end(served)
        finally:
            standby_task.cancel()
            with contextlib.suppress(BaseException):
                await standby_task


async def test_no_retention_keeps_every_ended_record(monkeypatch: pytest.MonkeyPatch) -> None:
    async with standalone_master(monkeypatch, poll_s=0.05, keep_ended_s=0.0) as master:
        served = await _submit(master, "kept")
        await _end(served)
        await async_wait_until(lambda: "default.kept" in master.replica.finished, what="seen ended")
        polls = master.polls.started["jobs"]
        await async_wait_until(
            lambda: master.polls.started["jobs"] >= polls + 40, what="40 more polls"
        )
        assert await _listed(master) == ["default.kept"] and master.replica.removed == 0


async def test_a_record_the_refresh_forgets_during_its_removal_fails_no_poll() -> None:
    """The leader's removal awaits the store; meanwhile the records refresh may list the bucket
    without the key and forget it (a KeyError once failed the poll: the soak counted it)."""
    replica = Replica(None, "nats://unused", ReplicaSettings(replica_id="m", keep_ended_s=1.0))

    class Racing(MemoryStore):
        async def remove(self, key: str, revision: int) -> bool:
            removed = await super().remove(key, revision)
            replica._forget_removed(await self.keys())  # the refresh, between two awaits
            return removed

    store = Racing()
    revisions = [await store.put(key, b"{}", expected_revision=None) for key in ("ns.a", "ns.b")]
    replica.store = store  # type: ignore[assignment]
    replica.lease = type("Held", (), {"held": True})()  # type: ignore[assignment]
    replica.finished = {k: Ended(0.0, r) for k, r in zip(("ns.a", "ns.b"), revisions, strict=True)}
    await replica._remove_expired(await store.keys())  # long after: both expired
    assert replica.removed == 2 and replica.finished == {} and await store.keys() == []


@pytest.mark.timing
async def test_a_quit_sent_before_the_master_adopted_the_job_still_ends_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The submitter quits at once, before any replica has subscribed to the job's events
    (the master polls for new jobs every 0.5 s): the quit is published again until the leader
    ends the job, so the job does not run on."""
    async with standalone_master(monkeypatch, poll_s=0.5) as master:
        spec = JobSpec(job="early-quit", namespace="default", worker_num=2, max_retry=1)
        served = await ServedJob.submit(
            master.bus, master.store, spec, ["node-0", "node-1"], NullPlatform()
        )
        served.server.sink(ev.QuitRequested("changed my mind"))
        assert not leads(master, "default.early-quit")  # nobody heard the first one
        async with asyncio.timeout(30):
            status = await served.wait(poll_s=0.05)
        assert status.phase in TERMINAL_PHASES
        repeating = served.server._repeating
        assert repeating is not None and served.server.quits_sent >= 2
        await async_wait_until(repeating.done, what="the repeats to stop once the job ended")
        assert served.server.ended.is_set()
        await served.close()
