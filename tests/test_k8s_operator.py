"""The whole operator (kopf, our registry, the real ``kubernetes`` client adapter) against
kmock's Kubernetes emulator on loopback: create an AegisJob, see its pods, fail one, see it
replaced off the ErrorNodes, fail the job, see every pod deleted."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest

from aegis.platforms.kubernetes import controller, manifests
from tests import k8s_emulator
from tests.test_k8s_handlers import exited, job_body
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(120)

JOBS, PODS = k8s_emulator.JOBS, k8s_emulator.PODS


@pytest.fixture
async def operator(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[kmock.KubernetesEmulator]:
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.watching.server_timeout = 10
    stop, ready = asyncio.Event(), asyncio.Event()
    registry = controller.build_registry(controller.real_cluster)
    task = asyncio.create_task(controller.serve(
        registry, namespaces=(), stop_flag=stop, ready_flag=ready, settings=settings))  # fmt: skip
    await asyncio.wait_for(ready.wait(), 20)
    try:
        yield kmock
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)


def _pod(emulator: kmock.KubernetesEmulator, name: str) -> dict[str, Any] | None:
    for (resource, namespace, found), obj in emulator.objects.items():
        if resource.plural == "pods" and (namespace, found) == ("ml", name) and not obj.deleted:
            raw: dict[str, Any] = obj.raw
            return raw
    return None


def _handled(emulator: kmock.KubernetesEmulator) -> bool:
    for (resource, _, name), obj in emulator.objects.items():
        if resource.plural == manifests.PLURAL and name == "train" and not obj.deleted:
            annotations = obj.raw.get("metadata", {}).get("annotations", {})
            return "kopf.zalando.org/last-handled-configuration" in annotations
    return False


def _live(emulator: kmock.KubernetesEmulator) -> set[str]:
    return {n for n in ("train-0", "train-1", "train-2") if _pod(emulator, n) is not None}


async def test_operator_runs_an_aegisjob_end_to_end_when_pods_and_job_fail(
    operator: kmock.KubernetesEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = job_body()
    body["metadata"]["uid"] = "uid-1"
    await operator.post(JOBS, json=body)
    await async_wait_until(
        lambda: _live(operator) == {"train-0", "train-1", "train-2"}, what="three pods"
    )
    await async_wait_until(lambda: _handled(operator), what="kopf done with the creation")
    first = _pod(operator, "train-1")
    assert first is not None and "affinity" not in first["spec"]

    # The master records node-b as bad; train-1 (on node-b) exits 1.
    status = {"phase": "Restarting", "error_nodes": [{"node": "node-b", "reason": "gpu", "ts": 1}]}
    await operator.patch(f"{JOBS}/train", json={"status": status})
    failed = exited(first, 1)
    await operator.patch(
        f"{PODS}/train-1", json={"spec": failed["spec"], "status": failed["status"]}
    )

    def replaced() -> bool:
        pod = _pod(operator, "train-1")
        return pod is not None and "affinity" in pod["spec"]

    await async_wait_until(replaced, 60, "train-1 replaced off node-b")
    pod = _pod(operator, "train-1")
    assert pod is not None
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-b"]
    assert _live(operator) == {"train-0", "train-1", "train-2"}

    # The master writes Failed: every pod goes.
    await operator.patch(f"{JOBS}/train", json={"status": {"phase": "Failed", "should_quit": True}})
    await async_wait_until(lambda: _live(operator) == set(), 60, "every pod deleted")
    assert not any(r.levelno >= logging.ERROR for r in caplog.records if "aegis" in r.name)
