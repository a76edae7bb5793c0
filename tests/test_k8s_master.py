"""The master's Kubernetes side against kmock's emulator, with a real nats-server, a real master
replica (the HA code) and the real ``kubernetes`` client adapter: the master learns a job from
its AegisJob and token Secret, writes the job's status into the AegisJob's status, asks for a
lost pod's replacement and learns where the operator placed it; ``aegis ctl drain`` records a
node on the AegisJob and cordons it, ``undrain`` releases it. The test plays the operator, the
scheduler and the agents (their messages on NATS)."""

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
import msgspec
import pytest

from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.phases import Phase
from aegis.master import control, control_file, drained_nodes
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
from tests.waits import async_wait_until

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(90)]

USER_LINE_0 = "max restarts 2, restarted 0 times; hardware problems rescheduled 0 times"


@dataclass
class Cluster:
    emulator: kmock.KubernetesEmulator
    bus: NatsBus
    store: KvStore
    api: cluster.KubernetesCluster
    log_dir: Path  # the leader's control file

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

    def cordoned(self, node: str) -> bool:
        obj = self.emulator.objects["v1/nodes", None, node]
        return bool(obj.raw.get("spec", {}).get("unschedulable"))

    def marked(self, node: str) -> bool:
        """Aegis's mark of its own cordon."""
        obj = self.emulator.objects["v1/nodes", None, node]
        annotations = obj.raw.get("metadata", {}).get("annotations") or {}
        return annotations.get(cluster.CORDONED_BY_AEGIS) == "true"

    async def ctl(self, command: control.Command, node: str) -> control.ControlReply:
        def build(inbox: str) -> control.ControlRequest:
            return control.ControlRequest(command, inbox, nodes=[node], reason="bios update",
                                          deadline_s=0.5)  # fmt: skip

        subject = control_file.read_control_file(self.log_dir / control_file.CONTROL_FILE).subject
        return await control.request(self.bus, build, inbox_prefix="_INBOX", subject=subject)


def scheduled(rank: int, node: str, uid: str, created: str) -> dict[str, Any]:
    """The operator's pod of ``rank`` as the API server and scheduler leave it."""
    pod = manifests.pod_manifest(manifests.view(job_body(replicas=2)), rank)
    pod["metadata"].update(uid=uid, creationTimestamp=created)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Running", "podIP": f"10.0.0.{rank + 10}"}
    return pod


@contextlib.asynccontextmanager
async def running(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    """The cluster, a NATS server, a master replica leading and its Kubernetes side."""
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    replica = Replica(None, server.url, ReplicaSettings(
        replica_id="m1", lease=LeaseSettings(lease_s=2.0),
        job=JobSettings(heartbeat_timeout_s=1.0, rendezvous=manifests.RENDEZVOUS_RULE),
        poll_s=0.1, log_dir=tmp_path / "master"))  # fmt: skip
    bus = await NatsBus.connect(server.url)
    store = await KvStore.open(bus, STATUS_BUCKET)
    api = cluster.KubernetesCluster(cluster.load_config())
    settings = master_side.KubernetesSettings(poll_s=0.1, cordon=True)
    record = drained_nodes.DrainedNodes(await KvStore.open(bus, drained_nodes.BUCKET))
    side = master_side.KubernetesSide(api, bus, store, settings, drained=record,
                                      leading=replica.leading.is_set)  # fmt: skip
    tasks = [asyncio.create_task(replica.run()), asyncio.create_task(side.run())]
    try:
        async with asyncio.timeout(30):
            await replica.leading.wait()  # it serves aegis ctl from then on
        yield Cluster(kmock, bus, store, api, tmp_path / "master")
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        await bus.close()
        await asyncio.to_thread(server.stop)


@pytest.fixture
async def k8s(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    async with running(kmock, tmp_path, monkeypatch) as found:
        yield found


async def post_job(k8s: Cluster, secret_owner: str = "uid-1") -> None:
    """What the user and the operator leave: the AegisJob, its token Secret, two pods placed."""
    body = job_body(replicas=2)
    del body["status"]
    await k8s.emulator.post(k8s_emulator.JOBS, json=body)
    owner = {"apiVersion": f"{manifests.GROUP}/{manifests.VERSION}", "kind": manifests.KIND,
             "name": "train", "uid": secret_owner}  # fmt: skip
    secret = {"metadata": {"name": "train-aegis-job-token", "namespace": "ml",
                           "ownerReferences": [owner]},
              "data": {"token": base64.b64encode(b"tok-1").decode()}}  # fmt: skip
    await k8s.emulator.post(k8s_emulator.SECRETS, json=secret)
    for rank, node in enumerate(("node-a", "node-b")):
        pod = scheduled(rank, node, f"u{rank}", "2020-01-01T00:00:00Z")
        await k8s.emulator.post(k8s_emulator.PODS, json=pod)


async def adopted(k8s: Cluster) -> dict[str, Any]:
    """The job posted, adopted by the leader and mirrored as Pending; returns its record."""
    await post_job(k8s)

    async def led() -> bool:
        record = await k8s.record()
        return record is not None and record.get("epoch", 0) > 0

    await async_wait_until(led, what="the leader adopts the job")
    record = await k8s.record()
    assert record is not None
    assert record["spec"] == {"job": "train", "namespace": "ml", "worker_num": 2, "max_retry": 2,
                              "software_restart": True, "repeat_limit": 3}  # fmt: skip
    assert record["token"] == "tok-1"
    assert [record["status"]["pod_infos"][p]["node"] for p in ("train-0", "train-1")] == [
        "node-a", "node-b"]  # fmt: skip

    async def mirrored_pending() -> bool:
        return k8s.status().get("phase") == "Pending"

    await async_wait_until(mirrored_pending, what="Pending in the AegisJob status")
    status = k8s.status()
    assert status["message"] == USER_LINE_0
    assert status["recover_count"] == 0 and status["error_nodes"] == []
    assert {c["type"]: c["status"] for c in status["conditions"]} == dict.fromkeys(
        ("Running", "Recovering", "Succeeded", "Failed"), "False"
    )
    assert status["pod_infos"]["train-1"]["node"] == "node-b"
    return record


async def test_a_job_whose_token_secret_another_object_owns_is_not_submitted(
    k8s: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """``train-aegis-job-token`` left by another object (a deleted AegisJob of the name, a
    PyTorchJob's): its token is never taken for this job, and nothing is submitted."""
    await post_job(k8s, secret_owner="uid-of-another")
    await async_wait_until(
        lambda: any("not submitted" in r.getMessage() for r in caplog.records),
        what="the refusal",
    )
    assert await k8s.record() is None
    [said] = [r.getMessage() for r in caplog.records if "not submitted" in r.getMessage()]
    assert "owned by ['uid-of-another'], not by uid-1" in said


async def test_master_learns_an_aegisjob_and_writes_its_status_back_through_a_replacement(
    k8s: Cluster,
) -> None:
    record = await adopted(k8s)
    # train-1's agent ACKs, then falls silent: the master wants a replacement.
    ack = m.Message(job="train", namespace="ml", pod="train-1", type=m.MessageType.ACK,
                    phase=Phase.PENDING, seq=record["status"]["seq"], ts=time.time(),
                    data=m.AckData(node="node-b", pod_ip="10.0.0.11"), id="ack-1")  # fmt: skip
    await k8s.bus.publish(
        worker_subject(job_subject_prefix("ml", "train"), "train-1"), codec.encode(ack)
    )

    async def replacing() -> bool:
        return k8s.status().get("replacing") == {"train-1": "u1"}

    await async_wait_until(replacing, what="train-1 listed for replacement in the status")
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

    await async_wait_until(moved, what="train-1 back on node-c in the status")
    pod = k8s.status()["pod_infos"]["train-1"]
    assert (pod["inner_phase"], pod["pod_ip"]) == ("Pending", "10.0.0.11")

    # Stopped (as `aegis ctl stop` or a platform would): Failed, with the reason in a condition.
    quit_event = pm.PlatformEvent(kind="quit", reason="stopped by the test")
    await k8s.bus.publish(pm.subject("ml", "train", "events"), msgspec.json.encode(quit_event))

    async def failed() -> bool:
        return k8s.status().get("phase") == "Failed"

    await async_wait_until(failed, what="Failed in the AegisJob status")
    status = k8s.status()
    assert status["should_quit"] is True
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Failed"]["status"], conditions["Failed"]["reason"]) == ("True", "Stopped")
    assert conditions["Failed"]["message"] == f"stopped by the test; {USER_LINE_0}"  # and why
    assert status["ended"] == "stopped by the test"
    assert conditions["Running"]["status"] == "False"
    assert manifests.view(k8s.job()).failed_or_stopped  # what the operator acts on


async def start_job(k8s: Cluster) -> None:
    await post_job(k8s)

    async def mirrored() -> bool:
        return k8s.status().get("phase") == "Pending"

    await async_wait_until(mirrored, what="the job adopted and its status mirrored")


def test_cordon_drained_without_kubernetes_is_a_one_line_error() -> None:
    argv = [sys.executable, "-m", "aegis.cli.main", "master", "--nats", "nats://127.0.0.1:1",
            "--insecure", "--cordon-drained"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "--cordon-drained" in line]
    assert len(lines) == 1 and "needs --kubernetes" in lines[0], result.stderr


def _send(k8s: Cluster, pod: str, kind: m.MessageType, data: m.Payload, seq: int = 0) -> Any:
    ident = f"{pod}-{time.monotonic_ns()}"
    msg = m.Message(job="train", namespace="ml", pod=pod, type=kind, phase=Phase.PENDING,
                    seq=seq, ts=time.time(), data=data, id=ident)  # fmt: skip
    return k8s.bus.publish(
        worker_subject(job_subject_prefix("ml", "train"), pod), codec.encode(msg)
    )


async def test_every_round_meets_at_rank_0s_current_pod_ip(k8s: Cluster) -> None:
    """The operator's pods each have their own IP. Every order that starts a round hands the
    ranks rank 0's pod IP (what its ACK says, from the downward API) and a port of the pod's own
    range; after rank 0's pod is replaced on another node, the next round meets at the new
    pod's IP. Before any address is known the headless service's name stands in."""
    orders: list[m.OrderData] = []

    async def on_order(subject: str, payload: bytes) -> None:
        msg = codec.decode(payload)
        if isinstance(msg.data, m.OrderData) and "MASTER_ADDR" in msg.data.env:
            orders.append(msg.data)

    await k8s.bus.subscribe(f"{job_subject_prefix('ml', 'train')}.master", on_order)
    await start_job(k8s)
    await _send(k8s, "train-0", m.MessageType.ACK, m.AckData("node-a", "10.0.0.10"))
    await _send(k8s, "train-1", m.MessageType.ACK, m.AckData("node-b", "10.0.0.11"))

    async def ordered(count: int) -> bool:
        return len(orders) >= count

    await async_wait_until(lambda: ordered(1), what="the bootcheck order")
    first = orders[0]
    assert first.order.value == "bootcheck" and first.env["MASTER_ADDR"] == "10.0.0.10"
    port = int(first.env["CHECK_MASTER_PORT"])
    assert manifests.RENDEZVOUS_PORT <= port < manifests.RENDEZVOUS_PORT + 2000
    # Only train-1 keeps its heartbeat: train-0 is lost, and replaced on node-c.
    beating = asyncio.create_task(_beat(k8s, "train-1"))
    try:

        async def replacing() -> bool:
            return "train-0" in (k8s.status().get("replacing") or {})

        await async_wait_until(replacing, what="train-0 listed for replacement")
        await k8s.emulator.delete(f"{k8s_emulator.PODS}/train-0")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        moved = scheduled(0, "node-c", "u0b", now)
        moved["status"]["podIP"] = "10.0.0.20"
        await k8s.emulator.post(k8s_emulator.PODS, json=moved)

        async def back() -> bool:
            pod = k8s.status().get("pod_infos", {}).get("train-0", {})
            return pod.get("pod_ip") == "10.0.0.20"

        await async_wait_until(back, what="train-0's new pod IP in the status")
        seen = len(orders)
        await _send(k8s, "train-0", m.MessageType.ACK, m.AckData("node-c", "10.0.0.20"))
        await async_wait_until(lambda: ordered(seen + 1), what="the next round's order")
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
    assert {o.env["MASTER_ADDR"] for o in orders[seen:]} == {"10.0.0.20"}, orders
    assert orders[seen].env != first.env  # another round, another port


async def _beat(k8s: Cluster, pod: str) -> None:
    while True:
        await _send(k8s, pod, m.MessageType.HEARTBEAT, m.HeartbeatData())
        await asyncio.sleep(0.2)


async def test_an_aegisjob_named_outside_the_rule_is_failed_with_the_reason(k8s: Cluster) -> None:
    body = job_body(replicas=2)
    del body["status"]
    body["metadata"]["name"] = "train.v2"  # a valid Kubernetes name, not an Aegis one
    await k8s.emulator.post(k8s_emulator.JOBS, json=body)

    def status() -> dict[str, Any]:
        for (resource, namespace, name), obj in k8s.emulator.objects.items():
            if resource.plural == manifests.PLURAL and (namespace, name) == ("ml", "train.v2"):
                found: dict[str, Any] = obj.raw.get("status") or {}
                return found
        return {}

    async def refused() -> bool:
        return status().get("phase") == "Failed"

    await async_wait_until(refused, what="the AegisJob marked Failed")
    assert status()["message"].startswith("refused: job name 'train.v2' is not a DNS label")
    assert await k8s.store.keys() == []  # never submitted
