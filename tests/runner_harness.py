"""The master's job runner under test: a recording platform, the in-memory bus and store (or a
real nats-server), a harness that sends a pod's reports and waits for the runner's queue, and the
steps to a running job. Shared by the runner's tests (``test_job_runner`` and its neighbours)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import worker_subject
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName, initial_status
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType, RecoveryLevel
from aegis.master import inbox
from aegis.master.job_runner import JobRunner, JobSettings, status_key
from aegis.wire import codec, eventlog
from aegis.wire import messages as m
from tests.waits import async_wait_until


class RecordingPlatform:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        self.calls.append(("replace", pod))

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        self.calls.append(("evict", pod, str(int(level))))

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        self.calls.append(("blacklist", node))

    async def end_job(self, job: str, phase: Phase) -> None:
        self.calls.append(("end", phase.value))


class Harness:
    def __init__(
        self,
        runner: JobRunner,
        bus: memory.MemoryBus,
        store: memory.MemoryStore,
        platform: RecordingPlatform,
    ) -> None:
        self.runner, self.bus, self.store, self.platform = runner, bus, store, platform
        self.orders: list[m.Message] = []
        self.store_revision_at_order: list[int] = []
        self.task: asyncio.Task[None] | None = None  # the job's loop

    async def on_order(self, subject: str, payload: bytes) -> None:
        self.orders.append(codec.decode(payload))
        current = await self.store.get(status_key(self.runner.spec))
        assert current is not None
        self.store_revision_at_order.append(current[1])

    async def send(
        self,
        pod: str,
        kind: m.MessageType,
        data: m.Payload,
        *,
        seq: int | None = None,
        phase: Phase | None = None,
        msg_id: str = "",
    ) -> None:
        s = self.runner.status
        msg = m.Message(
            job="job",
            namespace="ns",
            pod=pod,
            type=kind,
            phase=phase or s.phase,
            seq=s.seq if seq is None else seq,
            ts=0.0,
            data=data,
            id=msg_id,
        )
        await self.bus.publish(worker_subject(self.runner.prefix, pod), codec.encode(msg))
        await self.bus.flush()

    async def settle(self) -> None:
        await self.bus.flush()
        await async_wait_until(self.runner.queue.empty, what="queue drained")
        await self.bus.flush()


def healthy() -> m.ChecksData:
    result = m.CheckResult(CheckType.RUNTIME, True, "ok", 0.1, 0.0)
    return m.ChecksData(m.CheckResponse([result]))


def make_runner(
    tmp_path: Path, bus: Any, store: Any, platform: RecordingPlatform, **settings: float
) -> JobRunner:
    """A runner of a two-pod job (one retry) on nodes node-0 and node-1."""
    spec = JobSpec("job", "ns", 2, 1)
    return JobRunner(
        spec,
        initial_status(spec, [NodeName("node-0"), NodeName("node-1")]),
        bus=bus,
        store=store,
        platform=platform,
        settings=JobSettings(order_resend_s=60, **settings),
        log_dir=tmp_path,
    )


@pytest.fixture
async def harness(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The runner on the in-memory bus, or (``indirect`` param "nats") on a real nats-server."""
    server = None
    if getattr(request, "param", "memory") == "nats":
        server = EmbeddedNats(None)
        await asyncio.to_thread(server.start)
        bus: Any = await NatsBus.connect(server.url)
    else:
        bus = memory.MemoryBus()
    store, platform = memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform, heartbeat_timeout_s=0.5)
    async with running(Harness(runner, bus, store, platform)) as h:
        yield h
    if server is not None:
        await bus.close()
        await asyncio.to_thread(server.stop)


@contextlib.asynccontextmanager
async def running(h: Harness) -> AsyncIterator[Harness]:
    """``h``'s runner started on node-0 and node-1, its orders recorded; closed at the end."""
    await h.bus.subscribe(h.runner.master_subject, h.on_order)
    await h.runner.start(["node-0", "node-1"])
    h.task = asyncio.create_task(h.runner.run())
    try:
        yield h
    finally:
        h.runner.close()
        await asyncio.wait_for(h.task, 5)


def quit_input(runner: JobRunner) -> inbox.PlatformInput:
    """A last event for a job's queue (a test's end)."""
    return inbox.PlatformInput(ev.QuitRequested("test over"), eventlog.QuitRequestedRecord(ts=0.0))


async def to_running(h: Harness) -> None:
    for pod in ("job-0", "job-1"):
        await h.send(pod, m.MessageType.ACK, m.AckData())
    await h.settle()
    for pod in ("job-0", "job-1"):
        await h.send(pod, m.MessageType.FINISH, healthy())
    await h.settle()
    assert h.runner.status.phase is Phase.RUN_COMMAND
