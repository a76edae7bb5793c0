"""A standalone master remembers the nodes ``aegis ctl drain`` took out of service: a job it
adopts later is told of them (its platform gets a DRAIN request per node), and the record is in
the store (a new leader reads it). Undrain forgets the node."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

from aegis.adapters.memory import MemoryStore
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.adapters.ports import StoreConflictError
from aegis.core.model import JobSpec
from aegis.master import control, control_file, drained_nodes
from aegis.master.lease import LeaseSettings
from aegis.master.records import submit_job
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET
from aegis.wire import platform_msgs as pm
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(90)


async def test_drain_and_undrain_change_the_record_and_a_conflict_is_tried_again() -> None:
    store = MemoryStore()
    nodes = drained_nodes.DrainedNodes(store)
    assert await nodes.load() == {}
    await nodes.drain_node("node-1", "kernel upgrade")
    await nodes.drain_node("node-2", "bios")
    await nodes.undrain_node("node-1")
    await nodes.undrain_node("node-9")  # not drained: nothing to do
    assert await nodes.load() == {"node-2": "bios"}

    class Racing(MemoryStore):
        """Another writer gets in between this one's read and its first write."""

        raced = False

        async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
            if not self.raced:
                self.raced = True
                await super().put(key, b'{"node-7": "theirs"}', expected_revision=None)
            return await super().put(key, value, expected_revision=expected_revision)

    racing = drained_nodes.DrainedNodes(Racing())
    await racing.drain_node("node-1", "mine")
    assert await racing.load() == {"node-1": "mine", "node-7": "theirs"}


async def test_an_unreadable_record_drains_nothing_and_endless_conflicts_are_an_error() -> None:
    store = MemoryStore()
    await store.put(drained_nodes.KEY, b"not json", expected_revision=None)
    assert await drained_nodes.DrainedNodes(store).load() == {}

    class Busy(MemoryStore):
        async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
            raise StoreConflictError("conflict")

    with pytest.raises(StoreConflictError):
        await drained_nodes.DrainedNodes(Busy()).drain_node("node-1", "x")


@dataclass
class Master:
    bus: NatsBus
    store: KvStore
    replica: Replica
    log_dir: Path

    async def ctl(self, command: control.Command, node: str) -> control.ControlReply:
        """``aegis ctl`` as it is sent: to the leader's subject, from its control file."""

        def build(inbox: str) -> control.ControlRequest:
            return control.ControlRequest(command, inbox, nodes=[node], reason="bios update")

        subject = control_file.read_control_file(self.log_dir / control_file.CONTROL_FILE).subject
        return await control.request(self.bus, build, inbox_prefix="_INBOX", subject=subject)

    async def submit(
        self, job: str, nodes: tuple[str, str] = ("node-0", "node-1")
    ) -> asyncio.Queue[pm.PlatformRequest]:
        """Submit a job of two pods; the platform requests the leader sends it (but its
        ``resend`` on adoption: see ``test_platform_node_down``)."""
        requests: asyncio.Queue[pm.PlatformRequest] = asyncio.Queue()

        async def on_request(subject: str, payload: bytes) -> None:
            request = msgspec.json.decode(payload, type=pm.PlatformRequest)
            if request.kind is not pm.RequestKind.RESEND:
                requests.put_nowait(request)

        await self.bus.subscribe(pm.subject("default", job, "requests"), on_request)
        await self.bus.flush()
        spec = JobSpec(job=job, namespace="default", worker_num=2, max_retry=1)
        await submit_job(self.store, spec, list(nodes), "token")
        return requests


@pytest.fixture
async def master(tmp_path: Path) -> AsyncIterator[Master]:
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    settings = ReplicaSettings(replica_id="m1", lease=LeaseSettings(lease_s=2.0), poll_s=0.05,
                               log_dir=tmp_path)  # fmt: skip
    replica = Replica(None, server.url, settings)
    task = asyncio.create_task(replica.run())
    bus = await NatsBus.connect(server.url)
    try:
        async with asyncio.timeout(30):
            await replica.leading.wait()
        yield Master(bus, await KvStore.open(bus, STATUS_BUCKET), replica, tmp_path)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await bus.close()
        await asyncio.to_thread(server.stop)


async def test_a_job_adopted_after_a_drain_is_told_of_the_drained_node(master: Master) -> None:
    reply = await master.ctl("drain", "node-7")
    assert reply == control.ControlReply(True, "drained node-7: no pod runs there, nothing to move")
    requests = await master.submit("later", ("node-0", "node-7"))
    async with asyncio.timeout(30):
        request = await requests.get()
    assert (request.kind, request.node, request.reason) == (
        pm.RequestKind.DRAIN, "node-7", "bios update"
    )  # fmt: skip
    assert master.replica.runners["default.later"].platform.blacklist == {  # type: ignore[attr-defined]
        "node-7": "drained: bios update"
    }
    # Its pod placed on node-7 (the job's platform did not know yet) is drained.
    runner = master.replica.runners["default.later"]
    await async_wait_until(lambda: runner.status.drain_count == 1, what="the pod drained")
    assert runner.status.pod_infos["later-1"].drain
    assert runner.status.pod_infos["later-1"].last_failed_reason.startswith("drain: on a drained")
    # The record is in the store: a new leader reads the same.
    record = drained_nodes.DrainedNodes(await KvStore.open(master.bus, drained_nodes.BUCKET))
    assert await record.load() == {"node-7": "bios update"}

    assert (await master.ctl("undrain", "node-7")).ok
    assert await record.load() == {}
    requests = await master.submit("after-undrain")
    await async_wait_until(
        lambda: "default.after-undrain" in master.replica.runners, what="the job adopted"
    )
    assert master.replica.runners["default.after-undrain"].platform.blacklist == {}  # type: ignore[attr-defined]
    # Requests reach a job in the order sent: the first it gets is a later drain's, not node-7's.
    assert (await master.ctl("drain", "node-8")).ok
    async with asyncio.timeout(30):
        request = await requests.get()
    assert (request.kind, request.node) == (pm.RequestKind.DRAIN, "node-8")
