"""The master follows a PyTorchJob whose pods the admission webhook wrapped, against kmock's
emulator, with a real nats-server, a real master replica, the real ``kubernetes`` client
adapters and the webhook's real ``answer`` (kmock has no admission chain: the test admits each
pod through it, as the API server would, and posts the patched pod). As in
``test_k8s_master``, the test plays the training operator (it recreates a deleted pod), the
scheduler (it places a pod on the first node its affinity allows) and the agents (their
messages on NATS). A gpu check that fails on one node in the bootcheck round is recovered: the
master's side deletes that pod, the webhook keeps the controller's replacement off the bad
node, the replacement is announced back by its rank, and the PyTorchJob's status annotation
shows each step; the controller failing the job ends the master's job."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest

from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType
from aegis.master.job_runner import JobSettings
from aegis.master.lease import LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.kubernetes import (
    cluster,
    crd_status,
    manifests,
    master_side,
    webhook_cluster,
    webhook_patch,
    webhook_server,
    wrapped_jobs,
    wrapped_source,
)
from aegis.wire import codec
from aegis.wire import messages as m
from tests import k8s_emulator
from tests.waits import async_wait_until
from tests.webhook_pods import apply_patch, pytorchjob, pytorchjob_pod, review

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(90)]

PTJ = "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs/train"
# The first pods were made well before the fault (the master tells a replacement made after its
# decision by the time, to the second, when it does not know the replaced pod's uid).
EARLIER = "2020-01-01T00:00:00Z"
AEGIS = [sys.executable, "-m", "aegis.cli.main"]


@dataclass
class World:
    emulator: kmock.KubernetesEmulator
    bus: NatsBus
    store: KvStore
    hooks: webhook_cluster.WebhookCluster

    def obj(self, plural: str, name: str) -> dict[str, Any] | None:
        for (resource, namespace, found), obj in self.emulator.objects.items():
            if resource.plural == plural and (namespace, found) == ("ml", name):
                if obj.deleted:
                    return None
                raw: dict[str, Any] = obj.raw
                return raw
        return None

    def status(self) -> dict[str, Any]:
        return wrapped_jobs.status_of(self.obj("pytorchjobs", "train") or {})

    async def record(self) -> dict[str, Any] | None:
        got = await self.store.get("ml.train")
        return json.loads(got[0]) if got else None

    async def admit(
        self, kind: str, uid: str, ip: str, prefer: tuple[str, ...], created: str = EARLIER
    ) -> dict[str, Any]:
        """The controller creates the pod (at ``created``); the webhook wraps it; the scheduler
        places it on the first node of ``prefer`` its affinity allows."""
        pod = pytorchjob_pod(kind, 0, world=2)
        answer = await webhook_server.answer(review(pod), webhook_patch.WebhookSettings(),
                                             self.hooks)  # fmt: skip
        response = answer["response"]
        assert response["allowed"], response
        wrapped = apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
        node = next(n for n in prefer if allowed(wrapped, n))
        wrapped["metadata"].update(uid=uid, creationTimestamp=created)
        wrapped["spec"]["nodeName"] = node
        wrapped["status"] = {"phase": "Running", "podIP": ip}
        await self.emulator.post(k8s_emulator.PODS, json=wrapped)
        return wrapped

    async def says(self, pod: str, kind: m.MessageType, phase: Phase, seq: int,
                   data: m.Payload) -> None:  # fmt: skip
        msg = m.Message(job="train", namespace="ml", pod=pod, type=kind, phase=phase, seq=seq,
                        ts=time.time(), data=data, id=f"{pod}-{time.monotonic_ns()}")  # fmt: skip
        subject = worker_subject(job_subject_prefix("ml", "train"), pod)
        await self.bus.publish(subject, codec.encode(msg))


def allowed(pod: dict[str, Any], node: str) -> bool:
    """Whether the pod's required node affinity lets it onto ``node`` (hostname NotIn only)."""
    affinity = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not affinity:
        return True
    return any(
        all(e["operator"] != "NotIn" or node not in e["values"]
            for e in term.get("matchExpressions") or [])
        for term in affinity["nodeSelectorTerms"]
    )  # fmt: skip


@contextlib.asynccontextmanager
async def running(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[World]:
    """The cluster, a NATS server, a master replica leading and its wrapped-job side."""
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)  # no JobSet resource: that source is simply empty
    _declare_pytorchjobs(kmock)
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    replica = Replica(None, server.url, ReplicaSettings(
        replica_id="m1", lease=LeaseSettings(lease_s=2.0),
        # No step waits for a lost heartbeat: 5 s keeps a loaded machine's late one from
        # counting as a lost pod.
        job=JobSettings(heartbeat_timeout_s=5.0, rendezvous=manifests.RENDEZVOUS_RULE),
        poll_s=0.1))  # fmt: skip
    bus = await NatsBus.connect(server.url)
    store = await KvStore.open(bus, STATUS_BUCKET)
    api = wrapped_source.WrappedJobs(cluster.KubernetesCluster(cluster.load_config()))
    settings = master_side.KubernetesSettings(poll_s=0.1)
    side = wrapped_source.WrappedSide(api, bus, store, settings, leading=replica.leading.is_set)
    tasks = [asyncio.create_task(replica.run()), asyncio.create_task(side.run())]
    try:
        async with asyncio.timeout(30):
            await replica.leading.wait()
        yield World(kmock, bus, store, webhook_cluster.WebhookCluster(cluster.load_config()))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await bus.close()
        await asyncio.to_thread(server.stop)


@pytest.fixture
async def world(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[World]:
    async with running(kmock, tmp_path, monkeypatch) as found:
        yield found


def _declare_pytorchjobs(emulator: kmock.KubernetesEmulator) -> None:
    emulator.resources["kubeflow.org/v1/pytorchjobs"] = {  # type: ignore[assignment]
        "kind": "PyTorchJob", "singular": "pytorchjob", "namespaced": True,
        "verbs": {"get", "list", "watch", "create", "patch", "update", "delete"},
    }  # fmt: skip


def _job() -> dict[str, Any]:
    job = pytorchjob(workers=1)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["metadata"] = {"labels": {webhook_patch.INJECT: "true"}}
    job["metadata"]["annotations"] = {wrapped_jobs.MAX_RETRY: "2"}
    return job


@contextlib.asynccontextmanager
async def beating(world: World, pods: list[str]) -> AsyncIterator[None]:
    """The agents of ``pods`` send heartbeats while in the block."""

    async def beat() -> None:
        while True:
            for pod in pods:
                await world.says(pod, m.MessageType.HEARTBEAT, Phase.PENDING, 0,
                                 m.HeartbeatData())  # fmt: skip
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _adopted(world: World) -> list[m.OrderData]:
    """The PyTorchJob and its two pods admitted through the webhook, adopted by the leader and
    mirrored into the annotation; returns the orders the master will send (filled in as sent)."""
    world.emulator.objects["kubeflow.org/v1/pytorchjobs", "ml", "train"] = _job()
    orders: list[m.OrderData] = []

    async def on_order(subject: str, payload: bytes) -> None:
        msg = codec.decode(payload)
        if isinstance(msg.data, m.OrderData) and "MASTER_ADDR" in msg.data.env:
            orders.append(msg.data)

    await world.bus.subscribe(f"{job_subject_prefix('ml', 'train')}.master", on_order)
    await world.admit("master", "u0", "10.0.0.10", ("node-a",))
    await world.admit("worker", "u1", "10.0.0.11", ("node-b",))

    async def led() -> bool:
        record = await world.record()
        return record is not None and record.get("epoch", 0) > 0

    await async_wait_until(led, what="the leader adopts the PyTorchJob")
    record = await world.record()
    assert record is not None
    assert (record["spec"]["worker_num"], record["spec"]["max_retry"]) == (2, 2)
    secret = world.obj("secrets", crd_status.token_secret_name("train"))
    assert record["token"] == crd_status.token(secret)  # the Secret the webhook made
    infos = record["status"]["pod_infos"]
    assert [infos[p]["node"] for p in ("train-0", "train-1")] == ["node-a", "node-b"]

    async def pending() -> bool:
        return world.status().get("phase") == "Pending"

    await async_wait_until(pending, what="Pending in the PyTorchJob's status annotation")
    return orders


async def test_a_fault_on_a_wrapped_pytorchjob_is_recovered_off_the_bad_node(world: World) -> None:
    orders = await _adopted(world)
    async with beating(world, ["train-0"]):  # the healthy pod, throughout
        async with beating(world, ["train-1"]):  # until its node's fault
            for pod, node, ip in (("train-0", "node-a", "10.0.0.10"),
                                  ("train-1", "node-b", "10.0.0.11")):  # fmt: skip
                await world.says(pod, m.MessageType.ACK, Phase.PENDING, 0, m.AckData(node, ip))

            async def bootchecking() -> bool:
                return world.status().get("phase") == "BootChecking" and bool(orders)

            await async_wait_until(bootchecking, what="the bootcheck round")
            # The round meets at rank 0's pod IP (AEGIS_POD_IP in its ACK), not the AegisJob's
            # headless-service name, which a PyTorchJob does not have.
            assert orders[0].env["MASTER_ADDR"] == "10.0.0.10"
            bad = m.CheckResult(CheckType.GPU, passed=False, result="Xid 79: fell off the bus",
                                duration_s=0.1, ts=time.time())  # fmt: skip
            await world.says("train-0", m.MessageType.FINISH, Phase.BOOT_CHECKING, 1,
                             m.ChecksData(m.CheckResponse([])))  # fmt: skip
            await world.says("train-1", m.MessageType.FINISH, Phase.BOOT_CHECKING, 1,
                             m.ChecksData(m.CheckResponse([bad])))  # fmt: skip

            async def deleted() -> bool:
                return world.obj("pods", "train-worker-0") is None

            await async_wait_until(deleted, what="the master's side deletes train-worker-0")
        status = world.status()
        assert [e["node"] for e in status["error_nodes"]] == ["node-b"]
        assert status["replacing"] == {"train-1": "u1"}
        assert status["pod_infos"]["train-1"]["inner_phase"] == "Restarting"

        # The controller recreates the pod; the webhook keeps it off node-b.
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        replacement = await world.admit("worker", "u1b", "10.0.0.12", ("node-b", "node-c"), now)
        assert replacement["spec"]["affinity"] == manifests.avoid_nodes(["node-b"])
        assert replacement["spec"]["nodeName"] == "node-c"

        async def moved() -> bool:
            status = world.status()
            pod = status.get("pod_infos", {}).get("train-1", {})
            return pod.get("node") == "node-c" and not status.get("replacing")

        await async_wait_until(moved, what="train-1 back on node-c in the status annotation")
        assert world.obj("pods", "train-master-0") is not None  # the healthy pod stays

        # The training operator fails the PyTorchJob: the master's job ends with it.
        failed = {"type": "Failed", "status": "True", "reason": "PyTorchJobFailed",
                  "message": "backoff limit reached"}  # fmt: skip
        await world.emulator.patch(PTJ, json={"status": {"conditions": [failed]}})

        async def ended() -> bool:
            return world.status().get("phase") == "Failed"

        await async_wait_until(ended, what="Failed in the status annotation")
        assert world.status()["should_quit"] is True


async def test_a_pytorchjob_named_as_an_aegisjob_is_refused_and_never_submitted(
    world: World,
) -> None:
    """Both would be the job ``ml.train`` with one token Secret: the AegisJob keeps the name."""
    world.emulator.objects["aegis.dev/v1/aegisjobs", "ml", "train"] = {
        "apiVersion": "aegis.dev/v1", "kind": "AegisJob",
        "metadata": {"name": "train", "namespace": "ml"}, "spec": {"replicas": 2},
    }  # fmt: skip
    world.emulator.objects["kubeflow.org/v1/pytorchjobs", "ml", "train"] = _job()

    async def refused() -> bool:
        return world.status().get("phase") == "Failed"

    await async_wait_until(refused, what="the PyTorchJob's annotation says it is refused")
    assert world.status()["message"] == ("refused: an AegisJob of that name runs in the namespace")
    assert await world.store.keys() == []


@pytest.mark.timeout(180)  # a process of its own to start: slow on a loaded machine
async def test_aegis_master_kubernetes_follows_a_wrapped_pytorchjob(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command itself (``aegis master --kubernetes``, a real process) runs the wrapped-job
    source next to the AegisJob one: the PyTorchJob's status annotation is written."""
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)
    _declare_pytorchjobs(kmock)
    kmock.objects["kubeflow.org/v1/pytorchjobs", "ml", "train"] = _job()
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    log_path = tmp_path / "master.log"
    with log_path.open("ab") as out:
        proc = subprocess.Popen([*AEGIS, "master", "--nats", server.url, "--insecure",
                                 "--kubernetes", "--replica-id", "m1"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    bus = await NatsBus.connect(server.url)
    try:
        hooks = webhook_cluster.WebhookCluster(cluster.load_config())
        world = World(kmock, bus, await KvStore.open(bus, STATUS_BUCKET), hooks)
        await world.admit("master", "u0", "10.0.0.10", ("node-a",))
        await world.admit("worker", "u1", "10.0.0.11", ("node-b",))

        async def pending() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return world.status().get("phase") == "Pending"

        await async_wait_until(pending, 120, "Pending in the PyTorchJob's status annotation")
        assert world.status()["pod_infos"]["train-1"]["node"] == "node-b"
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)
        await bus.close()
        await asyncio.to_thread(server.stop)
