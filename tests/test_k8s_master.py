"""The master's Kubernetes side against kmock's emulator, with a real nats-server, a real master
replica (the HA code) and the real ``kubernetes`` client adapter: the master learns a job from
its AegisJob and token Secret, writes the job's status into the AegisJob's status, asks for a
lost pod's replacement and learns where the operator placed it. The test plays the operator,
the scheduler and one agent (an ACK on NATS, then silence)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import msgspec
import pytest

from aegis.adapters.nats_auth import job_subject_prefix
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.phases import Phase
from aegis.master.job_runner import JobSettings
from aegis.master.lease import LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.kubernetes import cluster, manifests, master_side
from aegis.wire import codec
from aegis.wire import messages as m
from aegis.wire import platform_msgs as pm
from tests import k8s_emulator
from tests.test_k8s_handlers import job_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

USER_LINE_0 = "max restarts 2, restarted 0 times; hardware problems rescheduled 0 times"


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    bus: NatsBus
    store: KvStore

    def job(self) -> dict[str, Any]:
        for (resource, namespace, name), obj in self.emulator.objects.items():
            if resource.plural == manifests.PLURAL and (namespace, name) == ("ml", "train"):
                raw: dict[str, Any] = obj.raw
                return raw
        raise AssertionError("no AegisJob ml/train")

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = self.job().get("status") or {}
        return found

    async def record(self) -> dict[str, Any] | None:
        got = await self.store.get("ml.train")
        return json.loads(got[0]) if got else None


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def scheduled(rank: int, node: str, uid: str, created: str) -> dict[str, Any]:
    """The operator's pod of ``rank`` as the API server and scheduler leave it."""
    pod = manifests.pod_manifest(manifests.view(job_body(replicas=2)), rank)
    pod["metadata"].update(uid=uid, creationTimestamp=created)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running", "podIP": f"10.0.0.{rank + 10}"}
    return pod


@pytest.fixture
async def k8s(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    replica = Replica(None, server.url, ReplicaSettings(
        replica_id="m1", lease=LeaseSettings(lease_s=2.0),
        job=JobSettings(heartbeat_timeout_s=1.0), poll_s=0.1))  # fmt: skip
    bus = await NatsBus.connect(server.url)
    store = await KvStore.open(bus, STATUS_BUCKET)
    api = cluster.KubernetesCluster(cluster.load_config())
    side = master_side.KubernetesSide(api, bus, store, master_side.KubernetesSettings(poll_s=0.1),
                                      leading=replica.leading.is_set)  # fmt: skip
    tasks = [asyncio.create_task(replica.run()), asyncio.create_task(side.run())]
    try:
        yield Cluster(kmock, bus, store)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await bus.close()
        await asyncio.to_thread(server.stop)


async def test_master_learns_an_aegisjob_and_writes_its_status_back_through_a_replacement(
    k8s: Cluster,
) -> None:
    body = job_body(replicas=2)
    del body["status"]
    await k8s.emulator.post(k8s_emulator.JOBS, json=body)
    secret = {"metadata": {"name": "train-aegis-token", "namespace": "ml"},
              "data": {"token": base64.b64encode(b"tok-1").decode()}}  # fmt: skip
    await k8s.emulator.post(k8s_emulator.SECRETS, json=secret)
    old = "2020-01-01T00:00:00Z"
    for rank, node in enumerate(("node-a", "node-b")):
        await k8s.emulator.post(k8s_emulator.PODS, json=scheduled(rank, node, f"u{rank}", old))

    async def led() -> bool:
        record = await k8s.record()
        return record is not None and record.get("epoch", 0) > 0

    await until(led, "the leader adopts the job")
    record = await k8s.record()
    assert record is not None
    assert record["spec"] == {"job": "train", "namespace": "ml", "worker_num": 2, "max_retry": 2}
    assert record["token"] == "tok-1"
    assert [record["status"]["pod_infos"][p]["node"] for p in ("train-0", "train-1")] == [
        "node-a", "node-b"]  # fmt: skip

    async def mirrored_pending() -> bool:
        return k8s.status().get("phase") == "Pending"

    await until(mirrored_pending, "Pending in the AegisJob status")
    status = k8s.status()
    assert status["message"] == USER_LINE_0
    assert status["recover_count"] == 0 and status["error_nodes"] == []
    assert {c["type"]: c["status"] for c in status["conditions"]} == dict.fromkeys(
        ("Running", "Recovering", "Succeeded", "Failed"), "False"
    )
    assert status["pod_infos"]["train-1"]["node"] == "node-b"

    # train-1's agent ACKs, then falls silent: the master wants a replacement.
    ack = m.Message(job="train", namespace="ml", pod="train-1", type=m.MessageType.ACK,
                    phase=Phase.PENDING, seq=record["status"]["seq"], ts=time.time(),
                    data=m.AckData(node="node-b", pod_ip="10.0.0.11"), id="ack-1")  # fmt: skip
    await k8s.bus.publish(f"{job_subject_prefix('ml', 'train')}.worker", codec.encode(ack))

    async def replacing() -> bool:
        return k8s.status().get("replacing") == {"train-1": "u1"}

    await until(replacing, "train-1 listed for replacement in the status")
    pod = k8s.status()["pod_infos"]["train-1"]
    assert (pod["inner_phase"], pod["last_failed_reason"]) == ("Restarting", "heartbeat lost")

    # The operator deletes it and creates the replacement; the scheduler puts it on node-c.
    await k8s.emulator.delete(f"{k8s_emulator.PODS}/train-1")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    await k8s.emulator.post(k8s_emulator.PODS, json=scheduled(1, "node-c", "u1b", now))

    async def moved() -> bool:
        status = k8s.status()
        pod = status.get("pod_infos", {}).get("train-1", {})
        return pod.get("node") == "node-c" and not status.get("replacing")

    await until(moved, "train-1 back on node-c in the status")
    pod = k8s.status()["pod_infos"]["train-1"]
    assert (pod["inner_phase"], pod["pod_ip"]) == ("Pending", "10.0.0.11")

    # Stopped (as `aegis ctl stop` or a platform would): Failed, with the reason in a condition.
    quit_event = pm.PlatformEvent(kind="quit", reason="stopped by the test")
    await k8s.bus.publish(pm.subject("ml", "train", "events"), msgspec.json.encode(quit_event))

    async def failed() -> bool:
        return k8s.status().get("phase") == "Failed"

    await until(failed, "Failed in the AegisJob status")
    status = k8s.status()
    assert status["should_quit"] is True
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Failed"]["status"], conditions["Failed"]["reason"]) == ("True", "Stopped")
    assert conditions["Failed"]["message"] == USER_LINE_0
    assert conditions["Running"]["status"] == "False"
    assert manifests.view(k8s.job()).failed_or_stopped  # what the operator acts on
