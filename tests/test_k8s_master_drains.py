"""``aegis ctl drain`` with the master's Kubernetes side, against kmock's emulator (the harness
of ``test_k8s_master``): a drained node is recorded on the AegisJob and cordoned, ``undrain``
releases it, a new leader learns the same, and a drained node's pod moves off it without a
fault being counted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest

from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.nats_bus import KvStore
from aegis.core.phases import Phase
from aegis.master import control, drained_nodes
from aegis.platforms.kubernetes import crd_status, manifests, master_side
from aegis.wire import codec
from aegis.wire import messages as m
from tests import k8s_emulator
from tests.test_k8s_master import Cluster, running, scheduled, start_job
from tests.waits import async_wait_until

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
async def k8s(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    async with running(kmock, tmp_path, monkeypatch) as found:
        yield found


async def test_a_drained_node_is_recorded_on_the_aegisjob_cordoned_and_released_by_undrain(
    k8s: Cluster,
) -> None:
    for node in ("node-a", "node-b", "node-c", "node-z", "node-y"):
        await k8s.emulator.post(k8s_emulator.NODES, json={"metadata": {"name": node}})
    admin_cordoned = {"metadata": {"name": "node-y"}, "spec": {"unschedulable": True}}
    await k8s.emulator.patch(f"{k8s_emulator.NODES}/node-y", json=admin_cordoned)
    await start_job(k8s)

    reply = await k8s.ctl("drain", "node-z")
    assert reply == control.ControlReply(True, "drained node-z: no pod runs there, nothing to move")

    def drained() -> dict[str, crd_status.DrainedNode]:
        return crd_status.drained_nodes(k8s.status())

    def recorded(node: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return node in drained()

        return check

    await async_wait_until(recorded("node-z"), what="node-z in the AegisJob's drained_nodes")
    assert drained()["node-z"].reason == "bios update" and drained()["node-z"].cordoned
    assert k8s.cordoned("node-z")
    assert k8s.status()["error_nodes"] == [] and k8s.status()["recover_count"] == 0
    # What the operator places next avoids the drained node.
    replacement = manifests.pod_manifest(manifests.view(k8s.job()), 1)
    assert (
        replacement["spec"]["affinity"]["nodeAffinity"]
        == manifests.avoid_nodes(["node-z"])["nodeAffinity"]
    )

    # A node the administrator had cordoned is recorded, but not Aegis's to uncordon.
    assert (await k8s.ctl("drain", "node-y")).ok
    await async_wait_until(recorded("node-y"), what="node-y in the AegisJob's drained_nodes")
    assert not drained()["node-y"].cordoned and k8s.cordoned("node-y")

    assert k8s.marked("node-z") and not k8s.marked("node-y")
    # A node the side cannot cordon (here: no such node) is still listed.
    assert (await k8s.ctl("drain", "node-q")).ok
    await async_wait_until(recorded("node-q"), what="node-q in the AegisJob's drained_nodes")
    assert not drained()["node-q"].cordoned
    assert (await k8s.ctl("undrain", "node-q")).ok

    # A new leader's side applies the same record: node-z is known as Aegis's cordon.
    assert await a_new_leaders_drains(k8s) == {"node-y": False, "node-z": True}

    reply = await k8s.ctl("undrain", "node-z")
    assert reply.ok, reply.message
    assert (await k8s.ctl("undrain", "node-y")).ok

    async def released() -> bool:
        return drained() == {} and not k8s.cordoned("node-z")

    await async_wait_until(released, what="node-z undrained and uncordoned")
    assert k8s.cordoned("node-y")  # still the administrator's
    assert not k8s.marked("node-z")


async def test_a_drain_and_undrain_with_no_job_running_still_cordon_and_uncordon(
    k8s: Cluster,
) -> None:
    """No AegisJob at all: the control reaches no job platform, the side applies the record."""
    await k8s.emulator.post(k8s_emulator.NODES, json={"metadata": {"name": "node-z"}})
    assert (await k8s.ctl("drain", "node-z")).ok

    async def cordoned() -> bool:
        return k8s.cordoned("node-z") and k8s.marked("node-z")

    await async_wait_until(cordoned, what="node-z cordoned by Aegis")
    assert (await k8s.ctl("undrain", "node-z")).ok

    async def uncordoned() -> bool:
        return not k8s.cordoned("node-z")

    await async_wait_until(uncordoned, what="node-z uncordoned")


async def says(k8s: Cluster, pod: str, kind: m.MessageType, phase: Phase, seq: int,
               data: Any) -> None:  # fmt: skip
    """What ``pod``'s agent would publish."""
    msg = m.Message(job="train", namespace="ml", pod=pod, type=kind, phase=phase, seq=seq,
                    ts=time.time(), data=data, id=f"{pod}-{time.monotonic()}")  # fmt: skip
    await k8s.bus.publish(worker_subject(job_subject_prefix("ml", "train"), pod), codec.encode(msg))


async def test_a_drain_moves_the_pod_off_its_node_without_counting_a_fault(k8s: Cluster) -> None:
    """The pod of a drained node leaves when the bootcheck round resolves (training is not
    running: nothing to checkpoint); the operator's replacement avoids the node; no fault."""
    for node in ("node-a", "node-b", "node-c"):
        await k8s.emulator.post(k8s_emulator.NODES, json={"metadata": {"name": node}})
    await start_job(k8s)
    pods = {"train-0": "node-a", "train-1": "node-b"}

    async def beating() -> None:
        while True:
            for pod in pods:
                await says(k8s, pod, m.MessageType.HEARTBEAT, Phase.PENDING, 0, m.HeartbeatData())
            await asyncio.sleep(0.2)

    heartbeats = asyncio.create_task(beating())
    try:
        reply = await k8s.ctl("drain", "node-b")
        assert reply.ok and "train-1" in reply.message, reply.message
        for pod, node in pods.items():
            await says(k8s, pod, m.MessageType.ACK, Phase.PENDING, 0, m.AckData(node=node))

        async def bootchecking() -> bool:
            return k8s.status().get("phase") == "BootChecking"

        await async_wait_until(bootchecking, what="the bootcheck round")
        passed = m.ChecksData(m.CheckResponse([]))
        for pod in pods:
            await says(k8s, pod, m.MessageType.FINISH, Phase.BOOT_CHECKING, 1, passed)

        async def replacing() -> bool:
            return k8s.status().get("replacing") == {"train-1": "u1"}

        await async_wait_until(replacing, what="train-1 listed for replacement")
        status = k8s.status()
        assert status["recover_count"] == 0 and status["error_nodes"] == []
        assert status["pod_infos"]["train-1"]["last_failed_reason"].startswith("drain: bios update")
        assert [d["node"] for d in status["drained_nodes"]] == ["node-b"]
        assert k8s.cordoned("node-b")
        replacement = manifests.pod_manifest(manifests.view(k8s.job()), 1)
        assert replacement["spec"]["affinity"] == manifests.avoid_nodes(["node-b"])

        await k8s.emulator.delete(f"{k8s_emulator.PODS}/train-1")
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await k8s.emulator.post(k8s_emulator.PODS, json=scheduled(1, "node-c", "u1b", now))

        async def moved() -> bool:
            status = k8s.status()
            return (
                status["pod_infos"]["train-1"].get("node") == "node-c" and not status["replacing"]
            )

        await async_wait_until(moved, what="train-1 on node-c")
    finally:
        heartbeats.cancel()  # the agents beat until the pod has moved, as real ones would
    assert k8s.status()["recover_count"] == 0


async def a_new_leaders_drains(k8s: Cluster) -> dict[str, bool]:
    """The drained nodes (and whether Aegis cordoned each) as a new leader's side learns them
    from the record and the nodes' marks in one sync; then it stops leading (its term ends)."""
    record = drained_nodes.DrainedNodes(await KvStore.open(k8s.bus, drained_nodes.BUCKET))
    settings = master_side.KubernetesSettings(cordon=True)
    leads = asyncio.Event()
    leads.set()
    fresh = master_side.KubernetesSide(k8s.api, k8s.bus, k8s.store, settings, drained=record,
                                       leading=leads.is_set)  # fmt: skip
    await fresh.sync_once()
    learned = {node: d.cordoned for node, d in fresh.drained.items()}
    leads.clear()
    await fresh.sync_once()
    return learned
