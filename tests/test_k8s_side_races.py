"""The master's Kubernetes side when its poll and a platform request interleave (found by CI: a
drained pod's replacement was never announced). A poll that read the job's record just before
the master decided to replace a pod must not forget the wait the request set meanwhile: the
pod replaced, still there, would otherwise pass for its own replacement, or the uid of the pod
replaced be lost; and two status writes computed against the same last write must not leave a
stale key on the resource. In-memory bus and store, a fake API, the interleaving forced by a
gate on a read or a write."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import msgspec

from aegis.adapters.memory import MemoryBus, MemoryStore
from aegis.core.model import NodeName, PodName, initial_status
from aegis.core.phases import Phase
from aegis.master import job_record
from aegis.master.job_settings import status_key
from aegis.platforms.kubernetes import crd_status, master_side
from aegis.wire import platform_msgs as pm
from tests.test_k8s_handlers import job_body
from tests.test_k8s_master import scheduled

Body = dict[str, Any]
NOW = 1_800_000_000.0  # the side's clock and the master's decision
CREATED = crd_status.rfc3339(NOW)  # every pod here was created in the decision's second


class Gate:
    """Once armed, the next call through it waits (having done its work, or before) until
    released: its caller then holds what the calls meanwhile make stale."""

    def __init__(self) -> None:
        self.armed = False
        self.paused, self.released = asyncio.Event(), asyncio.Event()

    async def passing(self) -> None:
        if self.armed:
            self.armed = False
            self.paused.set()
            await self.released.wait()


class GatedStore(MemoryStore):
    """A store whose gated read returns what was there when it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    async def get(self, key: str) -> tuple[bytes, int] | None:
        value = await super().get(key)
        await self.gate.passing()
        return value


class FakeApi:
    """The API server's part: the AegisJob (its status patched by merge), the job's pods. A
    gated status write reaches the server once released."""

    def __init__(self, pods: list[Body]) -> None:
        self.job = job_body(replicas=2)
        self.pods = pods
        self.gate = Gate()

    async def list_jobs(self, namespaces: Any) -> list[Body]:
        return [self.job]

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        return None

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        return list(self.pods)

    async def patch_job_status(self, namespace: str, name: str, status: Body) -> None:
        await self.gate.passing()
        self.job["status"] = _merged(self.job.get("status") or {}, status)

    def replacing(self) -> Body:
        return dict(self.job["status"].get("replacing") or {})

    async def cordon_node(self, node: str) -> bool:
        return True

    async def uncordon_node(self, node: str) -> None:
        return None


def _merged(target: Body, patch: Body) -> Body:
    """A JSON merge patch (RFC 7386) applied, as the API server does."""
    out = dict(target)
    for name, value in patch.items():
        if value is None:
            out.pop(name, None)
        elif isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = _merged(out[name], value)
        else:
            out[name] = value
    return out


def _records() -> tuple[bytes, bytes, bytes]:
    """The job's record: Pending; then BootChecking; then train-1 to be replaced."""
    spec = crd_status.job_spec(job_body(replicas=2))
    pending = initial_status(spec, [NodeName("node-a"), NodeName("node-b")], now=NOW - 60)
    checking = dataclasses.replace(pending, phase=Phase.BOOT_CHECKING, seq=1)
    pod = PodName("train-1")
    info = dataclasses.replace(pending.pod_infos[pod], inner_phase=Phase.RESTARTING,
                               updated_ts=NOW)  # fmt: skip
    replacing = dataclasses.replace(checking, pod_infos=checking.pod_infos.set(pod, info))
    notes = job_record.JobNotes(token="t", nodes=["node-a", "node-b"])
    return tuple(  # type: ignore[return-value]
        job_record.encode(job_record.build(spec, status, notes))
        for status in (pending, checking, replacing)
    )


class Side:
    """A side over the fakes, its job known (one poll done), the events it announces kept."""

    def __init__(self) -> None:
        self.pods = [scheduled(0, "node-a", "u0", CREATED), scheduled(1, "node-b", "u1", CREATED)]
        self.api, self.bus, self.store = FakeApi(self.pods), MemoryBus(), GatedStore()
        self.key = status_key(crd_status.job_spec(self.api.job))
        self.records = _records()
        self.store.data[self.key] = (self.records[0], 1)
        self.announced: list[pm.PlatformEvent] = []
        self.side = master_side.KubernetesSide(self.api, self.bus, self.store,
                                               master_side.KubernetesSettings(),
                                               clock=lambda: NOW)  # fmt: skip

    async def start(self) -> None:
        async def on_event(subject: str, payload: bytes) -> None:
            self.announced.append(msgspec.json.decode(payload, type=pm.PlatformEvent))

        await self.bus.subscribe(pm.subject("ml", "train", "events"), on_event)
        await self.poll()

    async def poll(self) -> None:
        await self.side.sync_once()
        await self.bus.flush(10)

    async def poll_while(self, gate: Gate, meanwhile: list[bytes]) -> None:
        """A poll held at ``gate`` while the master writes ``meanwhile`` and asks for train-1's
        replacement (the request's handler starts there, then the poll goes on)."""
        gate.armed = True
        poll = asyncio.create_task(self.side.sync_once())
        await asyncio.wait_for(gate.paused.wait(), 10)
        for revision, record in enumerate(meanwhile, start=2):
            self.store.data[self.key] = (record, revision)
        request = pm.PlatformRequest(kind=pm.RequestKind.REPLACE, key="r1", pod="train-1")
        await self.bus.publish(pm.subject("ml", "train", "requests"), msgspec.json.encode(request))
        gate.released.set()
        await asyncio.wait_for(poll, 10)
        await self.bus.flush(10)

    async def replaced(self) -> None:
        """The operator's replacement of train-1, on node-c, seen by a poll (twice)."""
        assert self.announced == []  # the pod replaced was never taken for its replacement
        self.api.pods = [self.pods[0], scheduled(1, "node-c", "u1b", CREATED)]
        await self.poll()
        await self.poll()
        assert [(e.kind, e.pod, e.node) for e in self.announced] == [
            ("restarted", "train-1", "node-c")
        ]  # said once, while the record still awaits it
        assert self.api.replacing() == {}


async def test_a_poll_that_read_the_record_before_a_replacement_keeps_the_wait() -> None:
    side = Side()
    await side.start()
    _, checking, replacing = side.records
    await side.poll_while(side.store.gate, [checking, replacing])
    assert side.api.replacing() == {"train-1": "u1"}
    await side.poll()
    assert side.api.replacing() == {"train-1": "u1"}  # still awaited, and as u1's
    await side.replaced()


async def test_a_status_write_in_flight_does_not_leave_a_stale_key() -> None:
    """A poll's write (computed against the last write) is on its way when the request's
    write lists train-1; once the replacement is back nothing lists it any more."""
    side = Side()
    await side.start()
    _, checking, replacing = side.records
    side.store.data[side.key] = (checking, 2)
    await side.poll_while(side.api.gate, [checking, replacing])
    assert side.api.replacing() == {"train-1": "u1"}
    await side.replaced()
