"""A job that ends while the lead moves: the leader writes the terminal status *before* it tells
the pods to exit and the platform to end the job; one that dies in between left the pods
running forever (a new leader filed the ended record away, its EXIT never sent). The record
says whether the end was carried out (``end_pending``): a new leader carries out what was not.
The dead leader is a ``JobRunner`` on the in-memory ports stopped right after its write; the
new one a ``Replica`` on a real nats-server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aegis.adapters import memory
from aegis.core.model import JobSpec, JobStatus, NodeName, initial_status
from aegis.core.phases import Order, Phase
from aegis.master.job_runner import JobRunner, JobSettings, status_key
from aegis.wire import codec
from aegis.wire import messages as m
from aegis.wire import platform_msgs as pm
from tests.poll_helpers import standalone_master
from tests.runner_harness import Harness, RecordingPlatform, to_running
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(180)

SPEC = JobSpec("job", "ns", 2, 1)


class _Died(Exception):
    """The leader's death right after a status write."""


async def _end_of(h: Harness, dies: bool) -> dict[str, Any]:
    await to_running(h)
    for pod in ("job-0", "job-1"):
        await h.send(pod, m.MessageType.FINISH, m.ExitData(0))
    assert h.task is not None
    await asyncio.wait([h.task], timeout=30)
    assert h.task.done()
    died = h.task.exception()  # (in the loop's task group)
    assert (died is not None and died.exceptions[0].__class__ is _Died) if dies else died is None
    got = await h.store.get(status_key(SPEC))
    assert got is not None
    return dict(json.loads(got[0]))


def _harness(tmp_path: Path, die_at: Phase | None) -> Harness:
    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()

    def after_persist(status: JobStatus) -> None:
        if status.phase is die_at:
            raise _Died(f"the leader dies after writing {status.phase}, before acting")

    status = initial_status(SPEC, [NodeName("node-0"), NodeName("node-1")])
    runner = JobRunner(SPEC, status, bus=bus, store=store, platform=platform,
                       settings=JobSettings(order_resend_s=60), log_dir=tmp_path,
                       after_persist=after_persist)  # fmt: skip
    return Harness(runner, bus, store, platform)


async def _started(h: Harness) -> Harness:
    await h.bus.subscribe(h.runner.master_subject, h.on_order)
    await h.runner.start(["node-0", "node-1"])
    h.task = asyncio.create_task(h.runner.run())
    return h


async def test_a_job_that_ends_under_one_leader_is_marked_carried_out(tmp_path: Path) -> None:
    h = await _started(_harness(tmp_path, die_at=None))
    record = await _end_of(h, dies=False)
    assert record["status"]["phase"] == "Succeed" and "end_pending" not in record
    assert [o.data.order for o in h.orders][-1] is Order.EXIT
    assert ("end", "Succeed") in h.platform.calls


async def test_a_new_leader_carries_out_the_end_its_predecessor_died_before(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    h = await _started(_harness(tmp_path, die_at=Phase.SUCCEED))
    record = await _end_of(h, dies=True)
    assert record["status"]["phase"] == "Succeed" and record["end_pending"] is True
    assert Order.EXIT not in [o.data.order for o in h.orders]  # the pods were never told
    assert h.platform.calls == []
    async with standalone_master(monkeypatch, poll_s=0.05) as master:
        orders: list[m.Message] = []
        requests: list[pm.PlatformRequest] = []

        async def on_order(subject: str, payload: bytes) -> None:
            orders.append(codec.decode(payload))

        async def on_request(subject: str, payload: bytes) -> None:
            requests.append(msgspec.json.decode(payload, type=pm.PlatformRequest))

        await master.bus.subscribe(h.runner.master_subject, on_order)
        await master.bus.subscribe(pm.subject("ns", "job", "requests"), on_request)
        await master.store.put("ns.job", json.dumps(record).encode(), expected_revision=None)
        await async_wait_until(lambda: "ns.job" in master.replica.finished, 60, "the end filed")
        await master.bus.flush()
        assert [(o.data.order, o.seq) for o in orders] == [(Order.EXIT, record["status"]["seq"])]
        assert [(r.kind, r.phase) for r in requests] == [(pm.RequestKind.END, "Succeed")]
        got = await master.store.get("ns.job")
        assert got is not None and "end_pending" not in json.loads(got[0])
        assert master.replica.runners == {}
