"""A pod with valid credentials that sends what no agent sends, on a real job runner (in-memory
bus and store): each message is dropped and counted, or kept as one short line, and the job's
loop goes on. Each of these once ended the loop, grew the record past what a NATS server
stores, or forged a line of the master's log."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import worker_subject
from aegis.core.model import PodName
from aegis.core.phases import Order, Phase
from aegis.master.job_runner import status_key
from aegis.master.safe_points import DECLINE_CHARS
from aegis.wire import codec
from aegis.wire import messages as m
from tests.runner_harness import Harness, RecordingPlatform, make_runner, to_running
from tests.waits import async_wait_until

pytestmark = pytest.mark.timing

FORGED = "\n2099-01-01 INFO aegis.master.job_runner: job job ended Succeed: every pod finished"


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A two-pod job in RunCommand on the in-memory bus; no pod is judged silent during a
    test on a loaded machine (heartbeat timeout 60 s)."""
    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform, heartbeat_timeout_s=60.0)
    h = Harness(runner, bus, store, platform)
    await bus.subscribe(runner.master_subject, h.on_order)
    await runner.start(["node-0", "node-1"])
    h.task = asyncio.create_task(runner.run())
    await to_running(h)
    yield h
    runner.close()
    await asyncio.wait_for(h.task, 10)


async def _send_raw(h: Harness, pod: str, kind: m.MessageType, data: dict[str, Any]) -> None:
    """A message as JSON, with ``data`` as given (values no struct of ours would encode)."""
    s = h.runner.status
    msg = {"job": "job", "namespace": "ns", "pod": pod, "type": kind.value, "phase": s.phase.value,
           "seq": s.seq, "ts": 0.0, "data": data}  # fmt: skip
    await h.bus.publish(worker_subject(h.runner.prefix, pod), json.dumps(msg).encode())
    await h.bus.flush()


def _alive(h: Harness) -> bool:
    return h.task is not None and not h.task.done()


async def test_a_step_no_float_holds_is_dropped_and_the_drain_goes_on(
    harness: Harness,
) -> None:
    """A heartbeat's step of 10**400 reached the step rate (int to float) and ended the loop
    when a drain asked for a checkpoint; a script's save of 2**60 the same way."""
    h = harness
    h.runner.drain((PodName("job-1"),), "maintenance", 600.0)
    await h.settle()
    hb, saved = m.MessageType.HEARTBEAT, m.MessageType.CHECKPOINT
    await _send_raw(h, "job-0", hb, {"kind": "heartbeat", "step": 10**400})
    await _send_raw(h, "job-0", hb, {"kind": "heartbeat", "step": -(2**60)})
    await _send_raw(h, "job-0", saved, {"kind": "script_saved", "step": 2**60})
    await _send_raw(h, "job-0", hb, {"kind": "heartbeat", "step": 10, "step_ts": 1e300})
    await h.settle()
    assert h.runner.drops.counts["schema"] == 4
    for step in (10, 20, 30):
        for pod in ("job-0", "job-1"):
            await h.send(pod, hb, m.HeartbeatData(step))
        await h.settle()

    def requested() -> bool:
        return any(isinstance(o.data, m.OrderData) and o.data.order is Order.CHECKPOINT
                   for o in h.orders)  # fmt: skip

    await async_wait_until(requested, what="the drain's checkpoint request")
    assert _alive(h) and h.runner.status.phase is Phase.RUN_COMMAND


async def test_a_declined_request_is_one_short_line_in_the_record_and_the_log(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reason for declining is the agent's short sentence. A longer one is dropped; a
    reason with newlines is logged and kept escaped, on one line, at most DECLINE_CHARS."""
    h = harness
    h.runner.drain((PodName("job-1"),), "maintenance", 600.0)
    await h.settle()
    huge = m.CheckpointDeclinedData("1", FORGED + "A" * 240_000)
    await h.send("job-0", m.MessageType.CHECKPOINT, huge)
    await h.settle()
    assert h.runner.drops.counts["schema"] == 1
    assert not any(i.drain is False and "AAAA" in i.last_failed_reason
                   for i in h.runner.status.pod_infos.values())  # fmt: skip
    caplog.set_level(logging.INFO, logger="aegis")
    said = m.CheckpointDeclinedData("1", "no requests taken" + FORGED + "B" * 900)
    await h.send("job-0", m.MessageType.CHECKPOINT, said)
    await async_wait_until(lambda: h.runner.status.phase is not Phase.RUN_COMMAND,
                           what="the drain forced (no save of the script known)")  # fmt: skip
    reason = h.runner.status.pod_infos[PodName("job-1")].last_failed_reason
    assert "no requests taken\\n2099-01-01 INFO" in reason and "\n" not in reason
    assert reason.count("B") < DECLINE_CHARS
    lines = [r.getMessage() for r in caplog.records]
    assert any("no requests taken\\n2099" in line for line in lines), lines
    assert not any("\n2099-01-01" in line for line in lines), lines
    assert _alive(h)
    stored = await h.store.get(status_key(h.runner.spec))
    assert stored is not None and len(stored[0]) < 20_000


async def test_an_order_from_a_pod_is_dropped_and_counted(
    harness: Harness,
) -> None:
    """Only the master orders: an Order on a worker's subject is no heartbeat."""
    h = harness
    await h.send("job-0", m.MessageType.ORDER, m.OrderData(Order.RUN))
    await h.settle()
    assert h.runner.drops.counts["not_a_report"] == 1 and _alive(h)


async def test_a_store_report_is_logged_on_one_line_and_a_path_too_long_is_dropped(
    harness: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = harness
    caplog.set_level(logging.INFO, logger="aegis")
    down = m.CheckpointStoreData("/ckpt" + FORGED, 5, errno=28, strerror="full" + FORGED,
                                 failures=1, opened=True)  # fmt: skip
    await h.send("job-0", m.MessageType.CHECKPOINT, down)
    too_long = m.CheckpointStoreData("/" + "d" * m.PATH_CHARS, 5, errno=28, failures=1)
    await h.send("job-0", m.MessageType.CHECKPOINT, too_long)
    await h.settle()
    [line] = [r.getMessage() for r in caplog.records if "checkpoint store" in r.getMessage()]
    assert "\n" not in line and "/ckpt\\n2099" in line and "full\\n2099" in line, line
    assert h.runner.drops.counts["schema"] == 1 and _alive(h)


def test_the_bounds_accept_what_agents_send() -> None:
    """The bounds leave room for every real value: a step of 2**53, an exit code of -9, a
    monotonic time of a year's uptime, a wall time, a why of 1000 characters."""
    beat = m.HeartbeatData(2**53, "x" * m.SHORT_CHARS, 3.2e7, 3.2e7, 0.01)
    hang = m.HangData(31.0, "s" * 200_000, 30.0, "w" * 1000)
    kinds = ((beat, m.MessageType.HEARTBEAT), (m.ExitData(-9), m.MessageType.FINISH),
             (hang, m.MessageType.HANG))  # fmt: skip
    for data, kind in kinds:
        msg = m.Message("job", "ns", "job-0", kind, Phase.RUN_COMMAND, 2**31, 1.8e9, data)
        assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("seq",), 2**53 + 1),
        (("epoch",), -(2**53) - 1),
        (("ts",), 1e300),
        (("data", "step"), 10**30),
        (("data", "hang_timeout"), "t" * (m.SHORT_CHARS + 1)),
    ],
)
def test_a_number_or_short_text_beyond_its_bound_is_malformed(
    path: tuple[str, ...], value: object
) -> None:
    msg: dict[str, Any] = {"job": "job", "namespace": "ns", "pod": "job-0", "type": "Heartbeat",
                           "phase": "RunCommand", "seq": 1, "ts": 1.0,
                           "data": {"kind": "heartbeat", "step": 1}}  # fmt: skip
    codec.decode(json.dumps(msg).encode())
    *parents, last = path
    target = msg
    for key in parents:
        target = target[key]
    target[last] = value
    with pytest.raises(codec.WireError) as caught:
        codec.decode(json.dumps(msg).encode())
    assert caught.value.reason == "schema"
