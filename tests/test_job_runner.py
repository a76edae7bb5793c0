"""The master's job shell with the in-memory bus and store: ordering, drops, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import worker_subject
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core import events as ev
from aegis.core.endings import Ending
from aegis.core.model import NodeName, PodName
from aegis.core.phases import Order, Phase
from aegis.master import faultlog, metrics
from aegis.master.job_runner import status_key
from aegis.wire import codec, job_summary
from aegis.wire import messages as m
from tests.runner_harness import (
    Harness,
    RecordingPlatform,
    healthy,
    make_runner,
    to_running,
)
from tests.scrape import parse, value
from tests.waits import async_wait_until

pytestmark = pytest.mark.timing


async def test_status_is_written_before_each_order_is_published(harness: Harness) -> None:
    await to_running(harness)
    await async_wait_until(lambda: len(harness.orders) == 2, what="bootcheck and run orders")
    assert [o.data.order for o in harness.orders] == [Order.BOOTCHECK, Order.RUN]  # type: ignore[union-attr]
    stored = await harness.store.get(status_key(harness.runner.spec))
    assert stored is not None
    assert json.loads(stored[0])["status"]["phase"] == "RunCommand"
    # the revision the store had when each order went out already held that order's round
    assert harness.store_revision_at_order == sorted(harness.store_revision_at_order)


@pytest.mark.parametrize("harness", ["memory", "nats"], indirect=True)
async def test_garbage_on_worker_subject_is_dropped_and_counted(harness: Harness) -> None:
    hub = metrics.MasterMetrics()
    hub.attach(harness.runner)
    await to_running(harness)
    before = harness.runner.status
    for raw in (
        b"{nope",
        b"[]",
        b"x" * (codec.MAX_MESSAGE_BYTES + 1),
        json.dumps({"job": "job"}).encode(),
    ):
        await harness.bus.publish(worker_subject(harness.runner.prefix, "job-0"), raw)
    await harness.send("job-0", m.MessageType.ERROR, m.ErrorData("old"), seq=before.seq - 1)
    other = m.Message(
        job="other",
        namespace="ns",
        pod="job-0",
        type=m.MessageType.ERROR,
        phase=Phase.RUN_COMMAND,
        seq=before.seq,
        ts=0,
        data=m.ErrorData("x"),
    )
    await harness.bus.publish(worker_subject(harness.runner.prefix, "job-0"), codec.encode(other))
    await harness.send("job-0", m.MessageType.FINISH, m.ExitData(0), msg_id="r1")
    await harness.send("job-0", m.MessageType.FINISH, m.ExitData(0), msg_id="r2")  # duplicate
    await harness.send("job-0", m.MessageType.FINISH, m.ExitData(0), msg_id="r1")  # re-sent id
    # On a real server delivery is asynchronous: wait for the 8 drops, then for the queue.
    await async_wait_until(lambda: sum(harness.runner.drops.counts.values()) >= 8, what="drops")
    await harness.settle()
    status = harness.runner.status
    assert status.phase is Phase.RUN_COMMAND and status.recover_count == 0
    assert [i.retries for i in status.pod_infos.values()] == [0, 0]
    drops = harness.runner.drops.counts
    assert drops["malformed"] == 1 and drops["schema"] == 2 and drops["oversized"] == 1
    assert drops["stale"] == 1 and drops["wrong_job"] == 1
    assert drops["duplicate"] == 1 and drops["duplicate_id"] == 1
    scraped = parse(hub.scrape())  # the same counts, as Prometheus sees them
    for reason in ("malformed", "schema", "oversized", "stale", "wrong_job", "duplicate"):
        assert value(scraped, "aegis_messages_dropped_total", reason=reason) == drops[reason]
    assert value(scraped, "aegis_messages_dropped_total") == 8


async def test_an_errno_this_host_cannot_name_adds_no_metric_series(harness: Harness) -> None:
    """A saver's errno is a peer's number: one this host has no name for is counted under
    "other", so a pod sending 1000 numbers adds one series, not 1000."""
    hub = metrics.MasterMetrics()
    hub.attach(harness.runner)
    await to_running(harness)
    for code in (28, 100_001, 100_002):
        data = m.CheckpointStoreData("/ckpt", step=5, errno=code, strerror="x", failures=2)
        await harness.send("job-0", m.MessageType.CHECKPOINT, data)
    await harness.settle()
    scraped = parse(hub.scrape())
    name = "aegis_checkpoint_persist_failures_total"
    assert value(scraped, name, errno="ENOSPC") == 2 and value(scraped, name, errno="other") == 4
    assert value(scraped, name) == 6


async def test_silent_pod_is_reported_lost_once(harness: Harness) -> None:
    await to_running(harness)

    async def beat() -> None:
        await harness.send("job-1", m.MessageType.HEARTBEAT, m.HeartbeatData())

    # job-1 keeps beating, job-0 falls silent: only job-0 is lost, counted once.
    await async_wait_until(lambda: harness.runner.status.phase is Phase.RESTARTING, what="loss")
    await beat()
    await harness.settle()
    assert ("replace", "job-0") in harness.platform.calls
    retries = {p: i.retries for p, i in harness.runner.status.pod_infos.items()}
    assert sum(retries.values()) == 1


async def test_each_run_round_gets_a_fresh_master_port(harness: Harness) -> None:
    await to_running(harness)
    await harness.send("job-0", m.MessageType.ERROR, m.ErrorData("crash"))
    await harness.settle()
    for pod in ("job-0", "job-1"):
        await harness.send(pod, m.MessageType.FINISH, healthy())
    await harness.settle()
    runs = [
        o
        for o in harness.orders
        if isinstance(o.data, m.OrderData) and o.data.order in (Order.RUN, Order.RESTART)
    ]
    assert len(runs) == 2
    ports = [o.data.env["MASTER_PORT"] for o in runs]  # type: ignore[union-attr]
    assert ports[0] != ports[1]


async def test_events_log_replays_to_the_same_status(harness: Harness, tmp_path: Path) -> None:
    from aegis.tools import replay

    await to_running(harness)
    await harness.send("job-1", m.MessageType.ERROR, m.ErrorData("crash"))
    await harness.settle()
    _, final = replay.final_status((tmp_path / "events.jsonl").read_text().splitlines())
    assert final == harness.runner.status


async def test_the_stored_record_says_why_the_job_ended(harness: Harness) -> None:
    """The status write that ends the job carries the master's words for it: ``aegis status
    --nats``, a standby that takes over and an AegisJob's condition read them there."""
    await to_running(harness)
    stored = await harness.store.get(status_key(harness.runner.spec))
    assert stored is not None and "ended" not in json.loads(stored[0])  # it runs
    harness.runner.platform_event(ev.QuitRequested("no healthy node left for job-1"))

    async def record() -> dict[str, Any]:
        got = await harness.store.get(status_key(harness.runner.spec))
        assert got is not None
        return dict(json.loads(got[0]))

    async def ended() -> bool:
        return (await record())["status"]["phase"] == "Failed"

    await async_wait_until(ended, what="the job's last status write")
    summary = job_summary.from_record(await record())
    assert (summary.ending, summary.ended) == (Ending.STOPPED, "no healthy node left for job-1")
    assert summary.outcome == "Failed: no healthy node left for job-1"


async def test_an_observer_that_fails_never_stops_the_job(harness: Harness) -> None:
    """A fault log on a full disk raised inside the job's loop and ended its task group; an
    observer's failure is now counted and logged, and the job goes on deciding."""

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    harness.runner.listeners.append(full_disk)
    harness.runner.message_listeners.append(full_disk)
    harness.runner.heartbeat_listeners.append(full_disk)
    await to_running(harness)
    await harness.send("job-0", m.MessageType.HEARTBEAT, m.HeartbeatData(3), msg_id="hb")
    await harness.send("job-1", m.MessageType.FINISH, m.ExitData(1), msg_id="fault")
    await harness.settle()
    assert harness.runner.status.phase is Phase.TROUBLESHOOTING  # still deciding
    assert harness.task is not None and not harness.task.done()  # its loop goes on
    assert harness.runner.observers.failures >= 5


async def test_a_drains_checkpoint_request_waits_for_steps_and_a_heartbeat_places_it(
    harness: Harness,
) -> None:
    """No step of this round known, no step lies surely ahead of every rank ("the next call"
    is a different step for a rank whose agent gets the order late): the request waits; the
    first heartbeats with steps place it, with no other event to wake the loop."""
    await to_running(harness)
    harness.runner.drain((PodName("job-1"),), "maintenance", 600.0)
    await harness.settle()
    assert harness.runner.status.drain_count == 1
    assert Order.CHECKPOINT not in [o.data.order for o in harness.orders]  # type: ignore[union-attr]
    for step in (10, 20):
        await harness.send("job-0", m.MessageType.HEARTBEAT, m.HeartbeatData(step))
    await async_wait_until(
        lambda: Order.CHECKPOINT in [o.data.order for o in harness.orders],  # type: ignore[union-attr]
        what="the checkpoint order",
    )
    [order] = [o.data for o in harness.orders if o.data.order is Order.CHECKPOINT]  # type: ignore[union-attr]
    assert int(order.env[m.CKPT_STEP_ENV]) > 20  # type: ignore[union-attr]


async def test_a_cancellation_that_a_write_swallowed_still_stops_the_job_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Python 3.11 nats-py's reply wait (``wait_for``) returns the reply when the task's
    cancellation comes with it: the status write under way when a master's service closed
    returned as if nothing had happened, and the job's loop went on deciding (a CI run hung,
    then named a pod lost 60 s later). The loop stops at its next turn all the same."""
    bus, store = memory.MemoryBus(), memory.MemoryStore()
    runner = make_runner(tmp_path, bus, store, RecordingPlatform())
    await runner.start(["node-0", "node-1"])
    writing, put = asyncio.Event(), store.put

    async def put_that_swallows(key: str, value: bytes, *, expected_revision: int | None) -> int:
        if not writing.is_set():  # the first write
            writing.set()
            # its reply is on its way, and arrives with the cancellation: 3.11's wait_for
            # returns the reply
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return await put(key, value, expected_revision=expected_revision)

    monkeypatch.setattr(store, "put", put_that_swallows)
    task = asyncio.create_task(runner.run())
    msg = m.Message(job="job", namespace="ns", pod="job-0", type=m.MessageType.ACK,
                    phase=Phase.PENDING, seq=0, ts=0.0, data=m.AckData())  # fmt: skip
    await bus.publish(worker_subject(runner.prefix, "job-0"), codec.encode(msg))
    await async_wait_until(writing.is_set, what="the ACK's status write")
    task.cancel()
    try:
        await async_wait_until(task.done, what="the job's loop to stop")
    finally:
        runner.close()  # (the loop went on) stop it all the same
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert task.cancelled()
    assert runner.status.outstanding == 1  # the ACK was taken; nothing after it was decided


async def test_a_pod_not_back_in_time_goes_elsewhere_and_a_refused_ack_keeps_it_awaited(
    tmp_path: Path,
) -> None:
    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(
        tmp_path, bus, store, platform, heartbeat_timeout_s=0.5, join_timeout_s=1.0
    )
    h = Harness(runner, bus, store, platform)
    await bus.subscribe(runner.master_subject, h.on_order)
    await runner.start(["node-0", "node-1"])
    faults = faultlog.FaultLog(tmp_path / "faults.jsonl")
    faults.attach(runner)
    h.task = asyncio.create_task(runner.run())
    beating = True

    async def beat() -> None:  # job-1 stays; job-0 falls silent once running
        while beating:
            await h.send("job-1", m.MessageType.HEARTBEAT, m.HeartbeatData())
            await asyncio.sleep(0.1)  # a heartbeat's pace, not a wait for a condition

    try:
        await to_running(h)
        beats = asyncio.create_task(beat())
        await async_wait_until(lambda: ("replace", "job-0") in platform.calls, what="the loss")
        # the lost agent, back from a partition, ACKs before any replacement was placed:
        # refused (it awaits its replacement), and it must not end the wait
        await h.send("job-0", m.MessageType.ACK, m.AckData())
        await h.settle()
        assert runner.status.pod_infos[PodName("job-0")].inner_phase is Phase.RESTARTING
        await async_wait_until(lambda: platform.calls.count(("replace", "job-0")) == 2,
                               what="the replacement asked for again")  # fmt: skip
        assert ("blacklist", "node-0") not in platform.calls  # never placed: no node to blame
        runner.platform_event(ev.PodRestarted(PodName("job-0"), NodeName("node-0")))
        await async_wait_until(lambda: ("blacklist", "node-0") in platform.calls,
                               what="the placed pod not back in time")  # fmt: skip
        assert platform.calls.count(("replace", "job-0")) == 3
        assert [e.node for e in runner.status.error_nodes] == ["node-0"]
        assert runner.status.recover_count == 1  # the loss only
        beating = False
        await beats
        lines = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
        said = [line["message"] for line in lines if line["kind"] == "report"]
        timed_out = [text for text in said if "did not come back" in text]
        assert len(timed_out) == 2, said  # the fault log says what was done each time
        assert timed_out[0].endswith("the pod is asked for again"), timed_out
        assert timed_out[1].endswith("its node is blacklisted, the pod is placed elsewhere")
    finally:
        runner.close()
        await asyncio.wait_for(h.task, 5)


async def test_a_master_whose_nats_server_hangs_judges_no_pod_silent_until_it_answers(
    tmp_path: Path,
) -> None:
    """A hung server (SIGSTOP; a partition between the master and NATS looks the same) keeps
    the master's connection open for minutes, and the master hears nobody. Before, it named
    every pod lost one heartbeat timeout in. Now a silence is judged only once the bus answers
    a round trip; after the outage every pod has a full timeout again."""
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    bus = await NatsBus.connect(server.url)
    store, platform = memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform, heartbeat_timeout_s=2.0)
    h = Harness(runner, bus, store, platform)  # type: ignore[arg-type]
    await bus.subscribe(runner.master_subject, h.on_order)
    await runner.start(["node-0", "node-1"])
    h.task = asyncio.create_task(runner.run())
    assert server.process is not None
    try:
        await to_running(h)
        server.process.send_signal(signal.SIGSTOP)
        try:
            await async_wait_until(lambda: runner.liveness.deaf, what="the master deaf")
            assert [c for c in platform.calls if c[0] == "replace"] == []
        finally:
            server.process.send_signal(signal.SIGCONT)
        await async_wait_until(lambda: not runner.liveness.deaf, what="the bus answering again")
        assert [c for c in platform.calls if c[0] == "replace"] == []  # a full timeout first
        assert runner.status.recover_count == 0
        await async_wait_until(lambda: ("replace", "job-0") in platform.calls,
                               what="a pod still silent a full timeout later")  # fmt: skip
    finally:
        runner.close()
        await asyncio.wait_for(h.task, 10)
        await bus.close()
        await asyncio.to_thread(server.stop)
