"""A job's name in the status store: a new job under the name of one that is not over is refused
(one readable error, nothing created); under the name of one that ended, it replaces it. Two
masters on one real nats-server (as two ``aegis run --nats URL --job NAME`` are)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import Authority, worker_subject
from aegis.adapters.nats_server import EmbeddedNats
from aegis.adapters.ports import Handler, Subscription
from aegis.core import events as ev
from aegis.core.errors import LocalError, SetupError
from aegis.core.model import JobSpec, NodeName, initial_status
from aegis.core.phases import Phase
from aegis.master import control, job_builder, job_record, records
from aegis.master.control_file import CONTROL_SUBJECT
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.job_settings import status_key
from aegis.master.ports import NullPlatform
from aegis.master.service import MasterService, MasterSettings
from aegis.spawn import owners
from aegis.wire import codec
from aegis.wire import messages as m
from tests.waits import async_wait_until

QUIET = JobSettings(heartbeat_timeout_s=60.0, order_resend_s=60.0)
SPEC = JobSpec("same", "default", 1, 1)


@contextlib.asynccontextmanager
async def master(
    server: EmbeddedNats, authority: Authority, answer_s: float = 5.0
) -> AsyncIterator[MasterService]:
    settings = MasterSettings(job=QUIET, creator_answer_s=answer_s)
    service = await MasterService.connect(authority, server.url, settings)
    try:
        yield service
    finally:
        await service.close()


async def create(service: MasterService, node: str) -> None:
    await service.create_job(SPEC, [node], NullPlatform(), log_dir=None)


async def stored(service: MasterService) -> tuple[str, str]:
    """The stored job's phase, and the node of its pod (which submission it is)."""
    found = await service.store.get(status_key(SPEC))
    assert found is not None
    _, _, status = records.decode_record(found[0])
    return status.phase.value, str(status.pod_infos["same-0"].node)


def _record(phase: Phase, creator: str = "", *, epoch: int = 0, end_pending: bool = False) -> bytes:
    status = dataclasses.replace(initial_status(SPEC, [NodeName("node-0")]), phase=phase)
    notes = job_record.JobNotes(token="t", creator=creator, end_pending=end_pending)
    return job_record.encode(job_record.build(SPEC, status, notes, epoch=epoch))


GONE, LIVE = (
    "boot=b ns=1 pid=100 ticks=5",
    "boot=b ns=1 pid=200 ticks=5",
)  # two masters' names: one gone, one running


@pytest.mark.parametrize(
    ("raw", "held"),
    [
        (_record(Phase.SUCCEED), None),
        (_record(Phase.FAILED, LIVE), None),
        (_record(Phase.RUN_COMMAND), "is not over (phase RunCommand)"),
        (_record(Phase.PENDING), "is not over (phase Pending)"),
        (_record(Phase.RUN_COMMAND, LIVE), "is not over (phase RunCommand)"),
        (_record(Phase.RUN_COMMAND, GONE), None),  # its master was killed: nobody leads it
        # adopted by a replica (a new epoch): its leader is not the creator any more
        (_record(Phase.RUN_COMMAND, GONE, epoch=2), "is not over (phase RunCommand)"),
        # ended, but the end's orders maybe not carried out yet: its leader still has work
        (_record(Phase.FAILED, LIVE, end_pending=True), "is ending (Failed"),
        (_record(Phase.SUCCEED, end_pending=True), "is ending (Succeed"),
        (_record(Phase.SUCCEED, GONE, end_pending=True), None),  # nobody left to carry it out
        (b"not json", "holds a record this version cannot read"),
    ],
)
def test_a_record_gives_up_its_name_once_its_job_ended_or_its_master_is_gone(
    raw: bytes, held: str | None
) -> None:
    why = records.still_held(raw, lambda creator: creator == GONE)
    assert why is None if held is None else (why is not None and why.startswith(held)), why


async def test_a_replica_that_adopts_a_job_leads_it_in_the_creators_place() -> None:
    """The record it writes names no creator: a gone ``aegis run`` frees no name it leads."""
    store, bus = memory.MemoryStore(), memory.MemoryBus()
    raw = _record(Phase.RUN_COMMAND, GONE)
    revision = await store.put(status_key(SPEC), raw, expected_revision=None)
    record, _, _ = records.decode_record(raw)
    builder = job_builder.JobBuilder(bus, store, QUIET)
    runner = builder.adopt(record, revision, NullPlatform(), None, epoch=2, fence=lambda: None)
    await runner.takeover()
    written = await store.get(status_key(SPEC))
    assert written is not None and written[1] > revision
    assert job_record.decode(written[0]).creator == ""
    assert records.still_held(written[0], lambda creator: True) is not None
    await runner.unsubscribe()


async def test_a_name_in_use_is_refused_and_an_ended_jobs_name_is_taken_over(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    async with master(nats_server, authority) as first, master(nats_server, authority) as second:
        await create(first, "node-1")
        with pytest.raises(records.JobExistsError) as refused:
            await create(second, "node-2")
        assert isinstance(refused.value, SetupError)  # the CLI says it in one line
        said = str(refused.value)
        assert said.startswith(f"job default/same in the status store of {nats_server.url} "
                               "is not over (phase Pending)"), said  # fmt: skip
        assert said.endswith("run it under another --job")
        assert second.jobs == {} and await stored(second) == ("Pending", "node-1")

        [runner] = first.jobs.values()
        runner.platform_event(ev.QuitRequested("the user stopped it"))
        assert runner.task is not None
        await runner.task  # its loop's end: the end carried out, and written

        async def ended() -> bool:
            return (await stored(second))[0] == "Failed"

        await async_wait_until(ended, what="the ended job's record")

        await create(second, "node-2")  # the ended job's record is replaced
        assert await stored(first) == ("Pending", "node-2")
        with pytest.raises(records.JobExistsError, match="exists"):  # and in one master: once
            await create(second, "node-3")


async def test_a_record_this_version_cannot_read_keeps_its_name(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    async with master(nats_server, authority) as service:
        await service.store.put(status_key(SPEC), b'{"spec": 1}', expected_revision=None)
        with pytest.raises(records.JobExistsError, match="holds a record this version cannot"):
            await create(service, "node-4")
        assert service.jobs == {}
        assert await service.store.get(status_key(SPEC)) is not None  # nothing lost


async def test_the_record_of_a_master_that_is_gone_gives_up_its_name(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """Its creator named in the record (a killed ``aegis run`` on this host leaves its job
    RunCommand for ever): a new job takes the name; while that master runs, it keeps it."""
    async with master(nats_server, authority) as first, master(nats_server, authority) as second:
        await create(first, "node-1")
        found = await first.store.get(status_key(SPEC))
        assert found is not None
        record, _, _ = records.decode_record(found[0])
        assert record.creator == owners.process_name()  # this process: it runs
        with pytest.raises(records.JobExistsError):
            await create(second, "node-2")

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = owners.process_name(child.pid)
    child.wait()
    left = msgspec.structs.replace(record, creator=dead)
    async with master(nats_server, authority) as third:
        now = await third.store.get(status_key(SPEC))  # as the first master left it
        assert now is not None
        await third.store.put(status_key(SPEC), job_record.encode(left), expected_revision=now[1])
        await create(third, "node-3")
        assert await stored(third) == ("Pending", "node-3")


class _HeldLastWrite(memory.MemoryStore):
    """The store; the write that says an ended job's end was carried out waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.holding, self.release = asyncio.Event(), asyncio.Event()

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        record = job_record.decode(value)
        if record.status["phase"] in ("Succeed", "Failed") and not record.end_pending:
            self.holding.set()
            await self.release.wait()
        return await super().put(key, value, expected_revision=expected_revision)


async def test_a_closing_master_lets_an_ended_jobs_last_write_finish() -> None:
    """``aegis run`` closes its master once the job is done, which is before the loop writes
    that the end was carried out: cancelled there, the record said ``end_pending`` for ever,
    and kept the name from every later run of it (from another host or container)."""
    store = _HeldLastWrite()
    service = MasterService(None, "nats://127.0.0.1:4222", memory.MemoryBus(), store,
                            MasterSettings(job=QUIET))  # fmt: skip
    runner, _ = await service.create_job(SPEC, ["node-0"], NullPlatform(), log_dir=None)
    runner.platform_event(ev.QuitRequested("the user stopped it"))
    await runner.wait_done()
    await store.holding.wait()  # the loop writes that the end was carried out
    started = asyncio.Event()

    async def close() -> None:
        started.set()
        await service.close()  # runs up to its first wait before this test goes on

    closing = asyncio.ensure_future(close())
    await started.wait()
    store.release.set()
    await asyncio.wait_for(closing, 60)
    found = await store.get(status_key(SPEC))
    assert found is not None
    record = job_record.decode(found[0])
    assert record.status["phase"] == "Failed" and not record.end_pending
    assert records.still_held(found[0], lambda creator: False) is None  # the name is free


ELSEWHERE = "boot=another-hosts-boot ns=1 pid=100 ticks=5"  # an aegis run on another host


async def _created_elsewhere(service: MasterService) -> JobRunner:
    """The stored record, as if an ``aegis run`` on another host had created the job; its runner
    goes on from that revision."""
    found = await service.store.get(status_key(SPEC))
    assert found is not None
    record = msgspec.structs.replace(job_record.decode(found[0]), creator=ELSEWHERE)
    [runner] = service.jobs.values()
    runner.revision = await service.store.put(
        status_key(SPEC), job_record.encode(record), expected_revision=found[1]
    )
    return runner


@contextlib.asynccontextmanager
async def _unanswered(
    server: EmbeddedNats, authority: Authority
) -> AsyncIterator[tuple[MasterService, MasterService, JobRunner]]:
    """Two masters; the first leads the job as if an ``aegis run`` on another host had created
    it, and answers no ping (cut off, or of an older version); the second asks for 1 s."""
    async with (
        master(server, authority) as first,
        master(server, authority, answer_s=1.0) as second,
    ):
        await create(first, "node-1")
        old = await _created_elsewhere(first)
        assert first.answering is not None
        await first.answering.unsubscribe()
        yield first, second, old


async def test_the_name_of_a_job_whose_creator_elsewhere_does_not_answer_is_taken(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """A run killed on another host left its job RunCommand for ever, and this host cannot tell
    whether that process lives: no master answers that it leads the job, so a new job takes the
    name (it was ``nats kv del`` by hand). The old master, if it was only cut off (here: its
    answers stopped), can write no more: its next write is refused and its loop ends."""
    assert owners.elsewhere(ELSEWHERE) and not owners.elsewhere(owners.process_name())
    async with _unanswered(nats_server, authority) as (_, second, old):
        await create(second, "node-2")
        assert await stored(second) == ("Pending", "node-2")
        old.platform_event(ev.QuitRequested("the user stopped it"))
        with pytest.raises(LocalError, match="loop ended early"):
            await old.wait_done()
        assert await stored(second) == ("Pending", "node-2")  # not overwritten


async def test_the_name_of_a_job_whose_creator_elsewhere_answers_stays_held(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """The master service that leads it answers the ping on the shared control subject (from
    its job's first record on, no control channel needed): the new job is refused in one line,
    and nothing is changed."""
    async with master(nats_server, authority) as first, master(nats_server, authority) as second:
        await create(first, "node-1")
        await _created_elsewhere(first)
        with pytest.raises(records.JobExistsError) as refused:
            await create(second, "node-2")
        assert str(refused.value) == (
            f"job default/same in the status store of {nats_server.url} is led by a run on "
            "another host or container (its master answers for it); run it under another --job"
        )
        assert second.jobs == {} and await stored(second) == ("Pending", "node-1")


async def test_the_name_of_a_job_whose_creator_elsewhere_has_pods_reporting_stays_held(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """No master answers (an older version's does not know ping), but the job's pods report on
    the subjects of the record's creation: the name stays held."""
    async with _unanswered(nats_server, authority) as (first, second, old):

        async def report(_: str, payload: bytes) -> None:  # (as pods report, every second)
            await first.bus.publish(worker_subject(old.prefix, "same-0"), b"{}")

        await first.bus.subscribe(CONTROL_SUBJECT, report)
        with pytest.raises(records.JobExistsError, match="a pod of it still reports"):
            await create(second, "node-2")
        assert second.jobs == {} and await stored(second) == ("Pending", "node-1")


async def test_a_name_whose_creator_cannot_be_parsed_is_not_asked_for(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """A creator named in another form (an older version's) is judged as before: the name is
    held, never freed by silence (that run would not answer a ping)."""
    async with master(nats_server, authority, answer_s=1.0) as service:
        await service.store.put(status_key(SPEC), _record(Phase.RUN_COMMAND, "ns=1 pid=2 ms=3"),
                                expected_revision=None)  # fmt: skip
        with pytest.raises(records.JobExistsError, match="is not over"):
            await create(service, "node-4")


class _YieldingBus(memory.MemoryBus):
    """Its subscribe lets other tasks run first, as a network round trip does."""

    async def subscribe(self, subject: str, handler: Handler) -> Subscription:
        await asyncio.sleep(0)  # (a turn of the loop, not a wait for time)
        return await super().subscribe(subject, handler)


async def test_jobs_created_at_once_are_answered_for_by_one_subscription() -> None:
    bus = _YieldingBus()
    service = MasterService(None, "nats://127.0.0.1:4222", bus, memory.MemoryStore(),
                            MasterSettings(job=QUIET))  # fmt: skip
    specs = [dataclasses.replace(SPEC, job=f"at-once-{i}") for i in range(3)]
    await asyncio.gather(*(service.create_job(s, ["n"], NullPlatform(), log_dir=None)
                           for s in specs))  # fmt: skip
    pings = [h for subject, h in bus.handlers.values() if subject == control.CONTROL_SUBJECT]
    assert len(pings) == 1 and len(service.jobs) == 3
    await service.close()


def _ack(node: str, ip: str) -> bytes:
    """Pod same-0's ACK, from where it says it is."""
    msg = m.Message(job="same", namespace="default", pod="same-0", type=m.MessageType.ACK,
                    phase=Phase.PENDING, seq=0, ts=time.time(), data=m.AckData(node, ip),
                    id=f"same-0/{ip}/0")  # fmt: skip
    return codec.encode(msg)


async def test_a_new_creation_of_a_name_shares_no_subject_with_the_old_one(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """A master cut off while a new run took its job's name goes on with its pods until its next
    write. They report on the subjects of their job's creation (``aegis.<ns>.<job>.<creation>``),
    which the new job's master never hears: here the old pod's ACK, then the new pod's, sent in
    that order on one connection. Before, both jobs used ``aegis.default.same``: the new master
    took the old pod's ACK for its own pod's, and met at the old pod's address."""
    async with _unanswered(nats_server, authority) as (first, second, old):
        await create(second, "node-2")
        [new] = second.jobs.values()
        assert new.prefix != old.prefix
        assert all(re.fullmatch(r"aegis\.default\.same\.[0-9a-f]{8}", j.prefix) for j in (old, new))
        await first.bus.publish(worker_subject(old.prefix, "same-0"), _ack("node-1", "10.0.0.1"))
        await first.bus.publish(worker_subject(new.prefix, "same-0"), _ack("node-2", "10.0.0.2"))
        await async_wait_until(lambda: new.status.phase is Phase.BOOT_CHECKING, what="the ACK")
        assert new.status.pod_infos["same-0"].pod_ip == "10.0.0.2"
        assert new.drops.total() == 0
        with pytest.raises(LocalError, match="loop ended early"):  # it took its pod's ACK: a
            await old.wait_done()  # write, refused (the name is the new run's)
        assert await stored(second) == ("BootChecking", "node-2")
