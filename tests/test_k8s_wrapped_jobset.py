"""The master follows the JobSet of a TrainJob whose pods the admission webhook wrapped (the
harness of ``test_k8s_wrapped_master``): ranks from the webhook's labels, the job ended when
the JobSet is deleted, and a new pod kept off the nodes the JobSet's status annotation names."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from aegis.platforms.kubernetes import manifests, webhook_patch, webhook_server, wrapped_jobs
from tests import k8s_emulator
from tests.test_k8s_wrapped_master import World, running
from tests.waits import async_wait_until
from tests.webhook_pods import apply_patch, jobset_pod, review

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(90)]


@pytest.fixture
async def world(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[World]:
    async with running(kmock, tmp_path, monkeypatch) as found:
        yield found


async def test_a_wrapped_jobset_is_followed_by_rank_and_ended_when_deleted(world: World) -> None:
    """A TrainJob's JobSet (pods with generated names): ranks come from the webhook's labels;
    deleting the JobSet ends the master's job."""
    world.emulator.resources["jobset.x-k8s.io/v1alpha2/jobsets"] = {  # type: ignore[assignment]
        "kind": "JobSet", "singular": "jobset", "namespaced": True,
        "verbs": {"get", "list", "watch", "create", "patch", "delete"},
    }  # fmt: skip
    world.emulator.objects["jobset.x-k8s.io/v1alpha2/jobsets", "ml", "llm"] = _jobset()
    for index, node in ((1, "node-y"), (0, "node-x")):
        pod = jobset_pod(index, nodes=2)
        answer = await webhook_server.answer(review(pod), webhook_patch.WebhookSettings(),
                                             world.hooks)  # fmt: skip
        wrapped = apply_patch(pod, json.loads(base64.b64decode(answer["response"]["patch"])))
        wrapped["metadata"].update(name=f"llm-node-0-{index}-abcde", uid=f"js{index}")
        wrapped["spec"]["nodeName"] = node
        await world.emulator.post(k8s_emulator.PODS, json=wrapped)

    async def led() -> bool:
        got = await world.store.get("ml.llm")
        return got is not None and json.loads(got[0]).get("epoch", 0) > 0

    await async_wait_until(led, what="the leader adopts the JobSet")
    got = await world.store.get("ml.llm")
    assert got is not None
    record = json.loads(got[0])
    assert record["spec"]["worker_num"] == 2
    infos = record["status"]["pod_infos"]
    assert [infos[p]["node"] for p in ("llm-0", "llm-1")] == ["node-x", "node-y"]
    await world.emulator.delete("/apis/jobset.x-k8s.io/v1alpha2/namespaces/ml/jobsets/llm")

    async def ended() -> bool:
        got = await world.store.get("ml.llm")
        return got is not None and json.loads(got[0])["status"]["should_quit"] is True

    await async_wait_until(ended, what="the master's job ended with its JobSet")


async def test_a_jobsets_new_pod_keeps_off_the_nodes_its_status_annotation_names(
    world: World,
) -> None:
    """The webhook reads the JobSet of a pod it wraps: a replacement is admitted with a node
    affinity off the ErrorNodes the master wrote into the JobSet's annotation."""
    world.emulator.resources["jobset.x-k8s.io/v1alpha2/jobsets"] = {  # type: ignore[assignment]
        "kind": "JobSet", "singular": "jobset", "namespaced": True,
        "verbs": {"get", "list", "watch", "create", "patch", "delete"},
    }  # fmt: skip
    body = _jobset()
    world.emulator.objects["jobset.x-k8s.io/v1alpha2/jobsets", "ml", "llm"] = body

    async def patch_of(index: int) -> list[dict[str, Any]]:
        pod = review(jobset_pod(index, nodes=2))
        answer = await webhook_server.answer(pod, webhook_patch.WebhookSettings(), world.hooks)
        assert answer["response"]["allowed"], answer
        ops: list[dict[str, Any]] = json.loads(base64.b64decode(answer["response"]["patch"]))
        return ops

    assert not [op for op in await patch_of(0) if op["path"] == "/spec/affinity"]
    status = {"error_nodes": [{"node": "node-y", "reason": "gpu", "ts": 1.0}]}
    annotated = {
        **body,
        "metadata": {**body["metadata"], "annotations": {wrapped_jobs.STATUS: json.dumps(status)}},
    }
    world.emulator.objects["jobset.x-k8s.io/v1alpha2/jobsets", "ml", "llm"] = annotated
    [affinity] = [op for op in await patch_of(1) if op["path"] == "/spec/affinity"]
    assert affinity["value"] == manifests.avoid_nodes(["node-y"])


def _jobset() -> dict[str, Any]:
    template = {
        "metadata": {"labels": {webhook_patch.INJECT: "true"}},
        "spec": {"containers": [{"name": "node", "image": "pytorch/pytorch:2.4.0"}]},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "llm", "namespace": "ml", "uid": "uid-js"},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
            "parallelism": 2, "completions": 2, "template": template}}}]},
    }  # fmt: skip
