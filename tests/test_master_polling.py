"""A master polls its status bucket for as long as it runs: listing the keys leaves nothing on
the server (a watcher per poll left a consumer for 300 s, and the stream's 1,000th made every
later poll fail), and a record that is not a job's is skipped and counted, never stops the poll.
Real nats-server; the master is a ``Replica`` in this process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest
from nats.aio.client import Client
from nats.js.errors import NotFoundError, ServiceUnavailableError

from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import TRANSIENT, KvStore, NatsBus
from aegis.adapters.nats_lease import NatsLeaseStore
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.model import JobSpec, NodeName, initial_status
from aegis.master import drained_nodes
from aegis.master.lease import LeaseSettings, nats_lease
from aegis.master.records import MalformedRecordError, decode_record, submit_job
from aegis.wire import status_json
from tests.poll_helpers import Master, consumer_counts, leads, standalone_master
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(300)

MORE_THAN_THE_CONSUMER_LIMIT = 1_200  # nats-server's default: 1,000 consumers per stream


async def test_keys_called_more_often_than_the_consumer_limit_leaves_no_consumer(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    bus = await NatsBus.connect(nats_server.url, authority.master_creds())
    try:
        store = await KvStore.open(bus, "polled")
        await store.put("ns.a", b"1", expected_revision=None)
        for index in range(MORE_THAN_THE_CONSUMER_LIMIT):
            if index % 400 == 0:  # keys come and go between the calls
                await store.put(f"ns.k{index:04d}", b"x", expected_revision=None)
            listed = await store.keys()
        assert listed == ["ns.a", "ns.k0000", "ns.k0400", "ns.k0800"]
        info = await bus.client.jetstream().stream_info("KV_polled")
        assert info.state.consumer_count <= 2, info.state.consumer_count
    finally:
        await bus.close()


class _PagedClient:
    """A server whose ``STREAM.INFO`` gives ``page`` subjects a page (the real one: 100,000)."""

    def __init__(self, subjects: list[str], page: int, error: dict[str, Any] | None = None):
        self.subjects, self.page, self.error = sorted(subjects), page, error
        self.requests: list[dict[str, Any]] = []

    async def request(self, subject: str, payload: bytes, timeout: float) -> SimpleNamespace:
        assert subject == "$JS.API.STREAM.INFO.KV_b"
        request = json.loads(payload)
        self.requests.append(request)
        if self.error is not None:
            return SimpleNamespace(data=json.dumps({"error": self.error}).encode())
        offset = request["offset"]
        part = self.subjects[offset : offset + self.page]
        state = {"subjects": {s: 1 for s in part}} if part else {}
        reply = {"total": len(self.subjects), "offset": offset, "state": state}
        return SimpleNamespace(data=json.dumps(reply).encode())


def _paged_store(client: _PagedClient) -> KvStore:
    kv = SimpleNamespace(_name="b", _js=SimpleNamespace(_nc=None, _prefix="$JS.API"))
    return KvStore(kv, client=cast(Client, client))


async def test_keys_reads_every_page_of_the_subject_index() -> None:
    subjects = [f"$KV.b.ns.j{i:02d}" for i in range(7)]
    client = _PagedClient(subjects, page=3)
    assert await _paged_store(client).keys() == [f"ns.j{i:02d}" for i in range(7)]
    assert [r["offset"] for r in client.requests] == [0, 3, 6]
    assert {r["subjects_filter"] for r in client.requests} == {"$KV.b.>"}
    empty = _PagedClient([], page=3)
    assert await _paged_store(empty).keys() == []
    assert len(empty.requests) == 1


async def test_keys_raises_the_servers_error_a_transient_one_as_transient() -> None:
    busy = {
        "code": 503,
        "err_code": 10008,
        "description": "JetStream system temporarily unavailable",
    }
    with pytest.raises(ServiceUnavailableError) as raised:
        await _paged_store(_PagedClient([], 3, error=busy)).keys()
    assert isinstance(raised.value, TRANSIENT)
    gone = {"code": 404, "err_code": 10059, "description": "stream not found"}
    with pytest.raises(NotFoundError):
        await _paged_store(_PagedClient([], 3, error=gone)).keys()


@pytest.mark.parametrize(
    "raw",
    [b"\x00not json", b"[1, 2]", b'"a string"', b'{"spec": {"job": "x"}}', b"[" * 100_000],
    ids=["bytes", "list", "string", "no-status", "deep"],
)
def test_decode_record_refuses_what_is_not_a_job(raw: bytes) -> None:
    with pytest.raises(MalformedRecordError):
        decode_record(raw)


def _job_record(job: str, **extra: object) -> bytes:
    spec = JobSpec(job=job, namespace="default", worker_num=2, max_retry=1)
    record = status_json.to_dict(spec, initial_status(spec, [NodeName("n0"), NodeName("n1")]))
    record.update(orders=[], epoch=0, token="t", nodes=["n0", "n1"])
    record.update(extra)
    return json.dumps(record).encode()


async def _submit(master: Master, job: str) -> str:
    spec = JobSpec(job=job, namespace="default", worker_num=2, max_retry=1)
    await submit_job(master.store, spec, ["node-0", "node-1"], "token")
    return f"default.{job}"


@pytest.mark.slow
async def test_the_master_polls_more_often_than_the_consumer_limit_and_still_adopts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with standalone_master(monkeypatch, poll_s=0.002) as master:
        polls = master.polls
        await async_wait_until(
            lambda: (
                min(polls.started["jobs"], polls.started["records"]) >= MORE_THAN_THE_CONSUMER_LIMIT
            ),
            240,
            f"{MORE_THAN_THE_CONSUMER_LIMIT} polls of each kind",
        )
        key = await _submit(master, "late")
        stored = polls.started["jobs"]  # polls begun by the time the record was stored
        await async_wait_until(lambda: key in master.replica.runners, what="the late job adopted")
        counts = await consumer_counts(master.bus)
        assert all(count <= 2 for count in counts.values()), counts
        # Adopted by the first poll that listed it, at the latest the first begun after its
        # record was stored (a poll that failed, none expected, would push it one further; the
        # submit itself spans several 2 ms polls on a loaded machine, so count from its end).
        assert polls.adopted_at[key] == polls.first_listed[key]
        assert polls.first_listed[key] <= stored + 1 + polls.failed["jobs"], polls
        assert polls.failed == {}, polls.failed


@pytest.mark.slow
async def test_a_malformed_record_is_skipped_counted_once_and_every_other_job_adopted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aegis.master.replica")
    async with standalone_master(monkeypatch, poll_s=0.01) as master:
        malformed = master.replica.malformed
        malformed.log_every_s = 3600.0  # one line for the whole test, however slow it runs
        bad = {  # listed before the jobs: an aborted poll would never reach them
            "default.a-bytes": b"\x00not json",
            "default.b-list": b"[1, 2]",
            "default.c-fields": b'{"spec": {"job": "c-fields"}}',
            "default.c-orders": _job_record("c-orders", orders=[{"order": "nonsense"}]),
        }
        revisions = {
            k: await master.store.put(k, v, expected_revision=None) for k, v in bad.items()
        }
        jobs = [await _submit(master, "d-job"), await _submit(master, "e-job")]
        # notes a new leader goes without, of another shape: dropped, and the job adopted
        odd_notes = _job_record("f-notes", pace={"best": "fast"}, safe_points=[1, 2])
        jobs.append("default.f-notes")
        await master.store.put(jobs[-1], odd_notes, expected_revision=None)
        runners = master.replica.runners
        await async_wait_until(
            lambda: all(job in runners for job in jobs), what="both jobs adopted"
        )
        await async_wait_until(
            lambda: malformed.count == len(bad), what="every malformed record counted"
        )
        assert malformed.revisions == revisions
        assert set(master.replica.records) >= set(jobs)  # the credentials handshake knows them

        later = master.polls.started["jobs"] + 20  # many more polls: each counted once
        await async_wait_until(lambda: master.polls.started["jobs"] >= later, what="20 more polls")
        assert malformed.count == len(bad)
        lines = [r for r in caplog.records if "malformed record" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]

        # A new malformed revision counts again; a record mended is a job, adopted.
        rev = await master.store.put(
            "default.a-bytes", b"{", expected_revision=revisions["default.a-bytes"]
        )
        mended = await master.store.put(
            "default.c-fields",
            _job_record("c-fields"),
            expected_revision=revisions["default.c-fields"],
        )
        await async_wait_until(
            lambda: "default.c-fields" in runners, what="the mended record adopted"
        )
        await async_wait_until(
            lambda: malformed.count == len(bad) + 1, what="the new bad revision counted"
        )
        assert malformed.revisions["default.a-bytes"] == rev
        assert "default.c-fields" not in malformed.revisions and mended > rev
        assert master.polls.failed == {}, master.polls.failed


async def test_a_standby_waits_for_the_lease_on_one_watcher_however_long_it_waits(
    nats_server: EmbeddedNats, authority: Authority
) -> None:
    """A standby opened a lease watcher per try (every <= 2 s), each a consumer that outlived
    its stop by minutes (~150 per standby). Now one serves the whole wait; the standby still
    leads as soon as the leader lets go."""
    bus = await NatsBus.connect(nats_server.url, authority.master_creds())
    settings = LeaseSettings(lease_s=1.0)
    leader, standby = (nats_lease(bus.client, name, settings) for name in ("m1", "m2"))
    assert isinstance(standby.store, NatsLeaseStore)
    try:
        for lease in (leader, standby):
            await lease.open()
        assert await leader.try_acquire()
        keeping = asyncio.create_task(leader.keep())
        tries = 0
        acquire = standby.try_acquire

        async def counted() -> bool:
            nonlocal tries
            tries += 1
            return await acquire()

        standby.try_acquire = counted  # type: ignore[method-assign]
        waiting = asyncio.create_task(standby.wait_for_lead())
        await async_wait_until(lambda: tries >= 8, what="eight tries of the standby")
        assert not waiting.done() and standby.store.watchers_opened == 1
        assert (await consumer_counts(bus))[settings.bucket] <= 1
        keeping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeping
        await leader.release()
        async with asyncio.timeout(30):
            epoch = await waiting
        assert epoch == standby.epoch and standby.store.watchers_opened == 1
        assert not standby.store.watching  # stopped once it led
    finally:
        await bus.close()


async def test_a_job_whose_adoption_failed_half_way_is_adopted_on_a_later_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One store error while adopting (the drained-nodes bucket electing its leader) left the
    job registered with no loop: never adopted again, no orders, no end, until the lead moved."""
    real_load = drained_nodes.DrainedNodes.load
    calls = 0

    async def load_failing_once(self: drained_nodes.DrainedNodes) -> dict[str, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise TimeoutError("drained bucket electing a leader")
        return await real_load(self)

    monkeypatch.setattr(drained_nodes.DrainedNodes, "load", load_failing_once)
    async with standalone_master(monkeypatch, poll_s=0.02) as master:
        key = await _submit(master, "hiccup")
        await async_wait_until(lambda: leads(master, key), 60, "the job adopted with its loop")
        assert calls >= 2  # the failed adoption, then the one that took
