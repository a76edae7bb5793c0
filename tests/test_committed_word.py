"""The master tells the pods each new step the whole job committed (``CommittedData``), once
its record holds it: their savers keep that step and the newest after it, so a pod ahead of one
whose store is down keeps the step the job resumes from."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aegis.adapters import memory
from aegis.master import job_record
from aegis.master.job_settings import status_key
from aegis.wire import codec
from aegis.wire import messages as m
from tests.runner_harness import (
    Harness,
    RecordingPlatform,
    healthy,
    make_runner,
    running,
    to_running,
)
from tests.waits import async_wait_until


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    """The runner on the in-memory bus; no pod is found silent in a test (they send no
    heartbeats), however loaded the machine. Each word's publish records the committed step
    the stored record held at that moment (``said_after``)."""
    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform, heartbeat_timeout_s=600)
    harness = Harness(runner, bus, store, platform)
    publish, stored = bus.publish, []

    async def publish_seeing_the_store(subject: str, payload: bytes) -> None:
        if isinstance(codec.decode(payload).data, m.CommittedData):
            got = await store.get(status_key(runner.spec))
            assert got is not None
            stored.append(job_record.decode(got[0]).committed_step)
        await publish(subject, payload)

    bus.publish = publish_seeing_the_store  # type: ignore[method-assign]
    harness.said_after = stored  # type: ignore[attr-defined]
    async with running(harness):
        yield harness


def words(h: Harness) -> list[int]:
    return [o.data.step for o in h.orders if isinstance(o.data, m.CommittedData)]


async def test_each_new_committed_step_is_told_once_after_the_record_holds_it(h: Harness) -> None:
    await to_running(h)
    await h.send("job-0", m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await h.settle()
    assert words(h) == []  # one pod only: not the job's
    await h.send("job-1", m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await async_wait_until(lambda: words(h) == [5], what="step 5 told")
    for pod in ("job-0", "job-1"):  # a repeated report commits nothing new
        await h.send(pod, m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await h.send("job-0", m.MessageType.CHECKPOINT, m.CheckpointData(10))
    await h.send("job-1", m.MessageType.CHECKPOINT, m.CheckpointData(10))
    await async_wait_until(lambda: words(h) == [5, 10], what="step 10 told")
    await h.settle()
    assert words(h) == [5, 10]
    assert h.said_after == [5, 10]  # type: ignore[attr-defined]  # the record held each first
    told = [o for o in h.orders if isinstance(o.data, m.CommittedData)]
    assert all(o.pod == "master" and o.type is m.MessageType.ORDER for o in told)


async def test_a_training_round_says_the_committed_step_again_before_its_order(
    h: Harness,
) -> None:
    """A pod that joined since the word was said (a replacement, a restarted agent) hears it
    before the order that starts its training."""
    await to_running(h)  # the first round: nothing committed, nothing said
    for pod in ("job-0", "job-1"):
        await h.send(pod, m.MessageType.CHECKPOINT, m.CheckpointData(8))
    await async_wait_until(lambda: words(h) == [8], what="step 8 told")
    await h.send("job-1", m.MessageType.ERROR, m.ErrorData("crashed", exit_code=1))
    await h.settle()
    for pod in ("job-0", "job-1"):  # the troubleshooting round finds both healthy
        await h.send(pod, m.MessageType.FINISH, healthy())
    await async_wait_until(lambda: words(h) == [8, 8], what="the restart's word")
    await h.settle()
    word, restart = h.orders[-2:]
    assert isinstance(word.data, m.CommittedData) and isinstance(restart.data, m.OrderData)
    assert word.seq == restart.seq and restart.data.env[m.RESUME_STEP_ENV] == "8"
