"""The operator's handlers, called directly against an in-memory cluster (the ClusterApi fake)."""

from __future__ import annotations

import copy
from typing import Any

from aegis.platforms.kubernetes import handlers, manifests

Body = dict[str, Any]


class FakeCluster:
    """In-memory pods, secrets, services and AegisJobs, keyed by (namespace, name)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], Body] = {}
        self.jobs: dict[tuple[str, str], Body] = {}
        self.secrets: dict[tuple[str, str], Body] = {}
        self.services: dict[tuple[str, str], Body] = {}
        self.deleted: list[str] = []

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        return [
            copy.deepcopy(p) for (ns, _), p in self.pods.items()
            if ns == namespace and p["metadata"]["labels"][manifests.LABEL_JOB] == job
        ]  # fmt: skip

    async def create_pod(self, namespace: str, body: Body) -> None:
        key = (namespace, body["metadata"]["name"])
        assert key not in self.pods, f"{key} exists"
        self.pods[key] = copy.deepcopy(body)

    async def delete_pod(self, namespace: str, name: str) -> None:
        if self.pods.pop((namespace, name), None) is not None:
            self.deleted.append(name)

    async def get_job(self, namespace: str, name: str) -> Body | None:
        return copy.deepcopy(self.jobs.get((namespace, name)))

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        self.secrets.setdefault((namespace, body["metadata"]["name"]), body)

    async def ensure_service(self, namespace: str, body: Body) -> None:
        self.services.setdefault((namespace, body["metadata"]["name"]), body)


def job_body(replicas: int = 3, **status: Any) -> Body:
    return {
        "apiVersion": "aegis.dev/v1", "kind": "AegisJob",
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-1"},
        "spec": {"replicas": replicas, "max_retry": 2, "template": {"spec": {"containers": [
            {"name": "trainer", "image": "img:1", "command": ["python", "train.py"]}]}}},
        "status": status,
    }  # fmt: skip


def exited(pod: Body, code: int, node: str = "node-b") -> Body:
    pod = copy.deepcopy(pod)
    pod["spec"]["nodeName"] = node
    pod["status"] = {"phase": "Failed" if code else "Succeeded", "containerStatuses": [
        {"name": "trainer", "image": "img:1", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": code}}}]}  # fmt: skip
    return pod


def _env(pod: Body) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def new_cluster(**status: Any) -> FakeCluster:
    cluster = FakeCluster()
    cluster.jobs[("ml", "train")] = job_body(**status)
    return cluster


async def test_job_created_makes_one_agent_pod_per_worker_when_the_job_is_new() -> None:
    cluster = new_cluster()
    created = await handlers.job_created(job_body(), cluster)
    assert created == ["train-0", "train-1", "train-2"]
    pod = cluster.pods[("ml", "train-1")]
    main = pod["spec"]["containers"][0]
    assert main["command"][:2] == ["/aegis/bin/aegis", "agent"]
    assert main["command"][-3:] == ["--", "python", "train.py"]
    assert "--pod" in main["command"] and "train-1" in main["command"]
    env = _env(pod)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == "0"
    assert env["PET_NODE_RANK"] == "1" and env["PET_NNODES"] == "3"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "train-0.train.ml.svc"
    assert pod["spec"]["initContainers"][0]["name"] == "aegis-agent"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert ("ml", "train-aegis-token") in cluster.secrets
    assert cluster.services[("ml", "train")]["spec"]["clusterIP"] == "None"


async def test_job_created_is_idempotent_when_resumed() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    del cluster.pods[("ml", "train-2")]
    assert await handlers.job_created(job_body(), cluster) == ["train-2"]


async def test_pod_uses_the_image_agent_when_mode_is_image() -> None:
    body = job_body()
    body["spec"]["agent"] = {"mode": "image"}
    pod = manifests.pod_manifest(manifests.view(body), 0)
    assert pod["spec"]["containers"][0]["command"][0] == "aegis"
    assert "initContainers" not in pod["spec"]


async def test_pod_exited_1_is_replaced_off_the_error_nodes_when_the_job_runs() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    running = job_body(phase="Restarting", error_nodes=[{"node": "node-b", "reason": "gpu"}])
    cluster.jobs[("ml", "train")] = running
    pod = exited(cluster.pods[("ml", "train-1")], 1)
    assert await handlers.pod_changed("MODIFIED", pod, cluster) == "deleted train-1"
    assert ("ml", "train-1") not in cluster.pods
    assert await handlers.pod_changed("DELETED", pod, cluster) == "created train-1"
    affinity = cluster.pods[("ml", "train-1")]["spec"]["affinity"]["nodeAffinity"]
    term = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-b"]}
    ]


async def test_pod_exited_0_is_left_alone_when_it_finished() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    cluster.jobs[("ml", "train")] = job_body(phase="RunCommand")
    pod = exited(cluster.pods[("ml", "train-0")], 0)
    assert await handlers.pod_changed("MODIFIED", pod, cluster) is None
    assert cluster.deleted == []


async def test_pod_is_not_recreated_when_the_job_failed() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    cluster.jobs[("ml", "train")] = job_body(phase="Failed", should_quit=True)
    pod = exited(cluster.pods[("ml", "train-0")], 1)
    assert await handlers.pod_changed("MODIFIED", pod, cluster) is None
    await cluster.delete_pod("ml", "train-0")
    assert await handlers.pod_changed("DELETED", pod, cluster) is None
    assert ("ml", "train-0") not in cluster.pods


async def test_status_failed_deletes_every_pod_when_the_master_writes_it() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    assert await handlers.job_status_changed(job_body(phase="RunCommand"), cluster) == []
    deleted = await handlers.job_status_changed(job_body(phase="Failed"), cluster)
    assert sorted(deleted) == ["train-0", "train-1", "train-2"]
    assert cluster.pods == {}


async def test_should_quit_deletes_every_pod_when_the_job_is_stopped() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    deleted = await handlers.job_status_changed(job_body(phase="RunCommand", should_quit=True),
                                                cluster)  # fmt: skip
    assert len(deleted) == 3
    cluster.jobs[("ml", "train")] = job_body(should_quit=True)
    assert await handlers.job_created(job_body(), cluster) == []
