"""The operator's handlers, called directly against an in-memory cluster (the ClusterApi fake)."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import pytest

from aegis.platforms.kubernetes import crd_status, handlers, manifests
from aegis.wire.tokens import pod_token
from tests.waits import async_wait_until

Body = dict[str, Any]


class FakeCluster:
    """In-memory pods, secrets, services and AegisJobs, keyed by (namespace, name)."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], Body] = {}
        self.jobs: dict[tuple[str, str], Body] = {}
        self.secrets: dict[tuple[str, str], Body] = {}
        self.services: dict[tuple[str, str], Body] = {}
        self.deleted: list[str] = []
        self.created: list[str] = []

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        return [
            copy.deepcopy(p) for (ns, _), p in self.pods.items()
            if ns == namespace and p["metadata"]["labels"][manifests.LABEL_JOB] == job
        ]  # fmt: skip

    async def create_pod(self, namespace: str, body: Body) -> bool:
        key = (namespace, body["metadata"]["name"])
        if key in self.pods:
            return False  # AlreadyExists
        self.pods[key] = copy.deepcopy(body)
        self.created.append(body["metadata"]["name"])
        return True

    async def delete_pod(self, namespace: str, name: str) -> None:
        if self.pods.pop((namespace, name), None) is not None:
            self.deleted.append(name)

    async def get_job(self, namespace: str, name: str) -> Body | None:
        return copy.deepcopy(self.jobs.get((namespace, name)))

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        self.secrets.setdefault((namespace, body["metadata"]["name"]), body)

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        return copy.deepcopy(self.secrets.get((namespace, name)))

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
    assert "--rejoin" not in main["command"]  # the job's first pods may run on their own
    env = _env(pod)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "3" and env["LOCAL_RANK"] == "0"
    assert env["PET_NODE_RANK"] == "1" and env["PET_NNODES"] == "3"
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "train-0.train.ml.svc"
    assert pod["spec"]["initContainers"][0]["name"] == "aegis-agent"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert ("ml", "train-aegis-job-token") in cluster.secrets
    assert cluster.services[("ml", "train")]["spec"]["clusterIP"] == "None"


async def test_each_pod_mounts_only_its_own_secret_derived_from_the_jobs() -> None:
    """Per-pod identity (issue 20): pod train-1 mounts ``train-1-aegis-pod-token`` (owner-only),
    holding pod_token(job secret, ml, train, train-1); the job's own Secret is mounted by
    no pod."""
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    job_token = crd_status.token(cluster.secrets[("ml", "train-aegis-job-token")])
    assert job_token
    for rank in range(3):
        pod = cluster.pods[("ml", f"train-{rank}")]
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == manifests.TOKEN_VOLUME]
        assert volume["secret"] == {
            "secretName": f"train-{rank}-aegis-pod-token",
            "defaultMode": 0o400,
        }
        secret = cluster.secrets[("ml", f"train-{rank}-aegis-pod-token")]
        assert crd_status.token(secret) == pod_token(job_token, "ml", "train", f"train-{rank}")
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert secret["metadata"]["labels"][manifests.LABEL_RANK] == str(rank)
    # a replacement of rank 2 mounts the same Secret, which keeps its content
    before = copy.deepcopy(cluster.secrets)
    del cluster.pods[("ml", "train-2")]
    assert await handlers.replace_rank("ml", "train", 2, cluster)
    assert cluster.secrets == before


async def test_a_jobs_secret_and_a_pods_never_share_a_name_and_another_objects_is_refused() -> None:
    """Job ``train-1`` and pod 1 of job ``train`` once both used ``train-1-aegis-token``, and a
    409 kept the Secret there: pod ``train-1`` could derive every pod token of job ``train-1``.
    The names differ now, and a Secret of the name owned by another object (an AegisJob made
    again under the name, a PyTorchJob's) is refused: no pod is made with a token from it."""
    assert crd_status.token_secret_name("train-1") != manifests.pod_token_secret_name(
        manifests.pod_name("train", 1)
    )
    for foreign in ("train-aegis-job-token", "train-1-aegis-pod-token"):
        cluster = new_cluster()
        cluster.secrets[("ml", foreign)] = {
            "metadata": {"name": foreign, "namespace": "ml",
                         "ownerReferences": [{"kind": "PyTorchJob", "name": "x", "uid": "uid-9"}]},
            "data": {"token": base64.b64encode(b"not-yours").decode()},
        }  # fmt: skip
        with pytest.raises(crd_status.SecretOwnerError, match="uid-9"):
            await handlers.job_created(job_body(), cluster)
        assert ("ml", "train-1") not in cluster.pods  # rank 1 never made with that token
        assert cluster.secrets[("ml", foreign)]["metadata"]["ownerReferences"][0]["uid"] == "uid-9"


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
    # placed again in a running job: its agent never runs the command on its own
    assert "--rejoin" in cluster.pods[("ml", "train-1")]["spec"]["containers"][0]["command"]
    assert "--rejoin" not in cluster.pods[("ml", "train-0")]["spec"]["containers"][0]["command"]
    affinity = cluster.pods[("ml", "train-1")]["spec"]["affinity"]["nodeAffinity"]
    term = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [
        {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-b"]}
    ]


async def test_replacement_avoids_the_drained_nodes_as_well_as_the_error_nodes() -> None:
    cluster = new_cluster()
    await handlers.job_created(job_body(), cluster)
    cluster.jobs[("ml", "train")] = job_body(
        phase="Restarting", error_nodes=[{"node": "node-b", "reason": "gpu"}],
        drained_nodes=[{"node": "node-z", "reason": "maintenance", "ts": 1.0}],
    )  # fmt: skip
    pod = exited(cluster.pods[("ml", "train-1")], 1)
    assert await handlers.pod_changed("MODIFIED", pod, cluster) == "deleted train-1"
    assert await handlers.pod_changed("DELETED", pod, cluster) == "created train-1"
    assert _avoided(cluster.pods[("ml", "train-1")]) == ["node-b", "node-z"]


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


def _avoided(pod: Body) -> list[str]:
    affinity = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    values: list[str] = terms.get("nodeSelectorTerms", [{}])[0]["matchExpressions"][0]["values"]
    return values


class PausingCluster(FakeCluster):
    """Its next ``list_pods`` waits for ``go``: a handler run caught between two API calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pause = False
        self.listing, self.go = asyncio.Event(), asyncio.Event()

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        if self.pause:
            self.pause = False
            self.listing.set()
            await self.go.wait()
        return await super().list_pods(namespace, job)


async def test_late_creation_run_places_the_replacement_off_the_error_nodes_when_it_races_a_fault(
) -> None:  # fmt: skip
    """kopf ran the creation handler a second time; that run was between reading the job and
    listing its pods when the master wrote ErrorNodes and the pod exited and was deleted. The
    old handler placed the replacement with the job as read before the fault (no affinity): the
    end-to-end test's flake."""
    cluster = PausingCluster()
    cluster.jobs[("ml", "train")] = job_body()
    locks = handlers.JobLocks()
    await handlers.job_created(job_body(), cluster, locks=locks)
    cluster.pause = True
    late = asyncio.create_task(handlers.job_created(job_body(), cluster, locks=locks))
    await cluster.listing.wait()
    cluster.jobs[("ml", "train")] = job_body(
        phase="Restarting", error_nodes=[{"node": "node-b", "reason": "gpu"}]
    )
    pod = exited(cluster.pods[("ml", "train-1")], 1)
    assert await handlers.pod_changed("MODIFIED", pod, cluster, locks=locks) == "deleted train-1"
    gone = asyncio.create_task(handlers.pod_changed("DELETED", pod, cluster, locks=locks))
    cluster.go.set()
    results = [await late, await gone]
    assert results in ([["train-1"], None], [[], "created train-1"])
    assert _avoided(cluster.pods[("ml", "train-1")]) == ["node-b"]
    assert cluster.created.count("train-1") == 2  # the first pod and exactly one replacement


async def test_deleted_pod_brings_back_only_its_rank_when_another_rank_is_missing_too() -> None:
    cluster = new_cluster(phase="RunCommand")
    await handlers.job_created(job_body(), cluster)
    del cluster.pods[("ml", "train-2")]  # its own DELETED event will bring it back
    pod = exited(cluster.pods.pop(("ml", "train-0")), 1)
    assert await handlers.pod_changed("DELETED", pod, cluster) == "created train-0"
    assert ("ml", "train-2") not in cluster.pods


async def test_deleted_pod_is_not_created_twice_when_it_is_already_back() -> None:
    cluster = new_cluster(phase="RunCommand")
    await handlers.job_created(job_body(), cluster)
    pod = exited(cluster.pods[("ml", "train-0")], 1)
    assert await handlers.pod_changed("DELETED", pod, cluster) is None  # AlreadyExists
    assert cluster.created == ["train-0", "train-1", "train-2"]


class FlakyCluster(FakeCluster):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def create_pod(self, namespace: str, body: Body) -> bool:
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError("apiserver hiccup")
        return await super().create_pod(namespace, body)


async def test_replacement_is_retried_when_the_api_call_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers, "CREATE_BACKOFF_S", 0.0)
    cluster = FlakyCluster(failures=2)
    cluster.jobs[("ml", "train")] = job_body(phase="RunCommand")
    assert await handlers.replace_rank("ml", "train", 1, cluster)
    assert cluster.created == ["train-1"]


async def test_lost_pod_is_deleted_when_the_master_lists_it_for_replacement() -> None:
    cluster = new_cluster(phase="Restarting")
    await handlers.job_created(job_body(), cluster)
    cluster.pods[("ml", "train-1")]["metadata"]["uid"] = "u1"
    cluster.pods[("ml", "train-2")]["metadata"]["uid"] = "u2"
    body = job_body(phase="Restarting", replacing={"train-1": "u1"})
    assert await handlers.job_status_changed(body, cluster) == ["train-1"]
    # The replacement (another uid) is never deleted for the same entry.
    await handlers.replace_rank("ml", "train", 1, cluster)
    cluster.pods[("ml", "train-1")]["metadata"]["uid"] = "u1b"
    assert await handlers.job_status_changed(body, cluster) == []
    assert sorted(n for _, n in cluster.pods) == ["train-0", "train-1", "train-2"]


async def test_an_aegisjob_named_outside_the_rule_gets_no_pods() -> None:
    """Kubernetes allows ``my.job``; Aegis's subjects would not keep it apart from ``my``."""
    cluster = FakeCluster()
    body = job_body()
    body["metadata"]["name"] = "my.job"
    cluster.jobs[("ml", "my.job")] = body
    assert await handlers.job_created(body, cluster) == []
    assert cluster.pods == {} and cluster.secrets == {} and cluster.services == {}


class CreatePausingCluster(FakeCluster):
    """Its next ``create_pod`` waits for ``go``: a replacement caught after it read the job."""

    def __init__(self) -> None:
        super().__init__()
        self.pause = False
        self.creating, self.go = asyncio.Event(), asyncio.Event()

    async def create_pod(self, namespace: str, body: Body) -> bool:
        if self.pause:
            self.pause = False
            self.creating.set()
            await self.go.wait()
        return await super().create_pod(namespace, body)


class CountingLocks(handlers.JobLocks):
    """Counts the times a handler asked for a job's lock."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def of(self, namespace: str, job: str) -> asyncio.Lock:
        self.asked += 1
        return super().of(namespace, job)


async def test_replacement_under_way_when_the_job_fails_is_deleted_with_the_other_pods() -> None:
    """The operator end-to-end test's flake: a replacement read the job while it ran, the
    master wrote Failed, the deletion listed the pods before the replacement was made, and
    the replacement outlived the job."""
    cluster = CreatePausingCluster()
    cluster.jobs[("ml", "train")] = job_body(phase="Restarting")
    locks = CountingLocks()
    await handlers.job_created(job_body(), cluster, locks=locks)
    pod = exited(cluster.pods.pop(("ml", "train-1")), 1)
    cluster.pause = True
    replacing = asyncio.create_task(handlers.pod_changed("DELETED", pod, cluster, locks=locks))
    await cluster.creating.wait()
    failed = job_body(phase="Failed", should_quit=True)
    cluster.jobs[("ml", "train")] = failed
    asked = locks.asked
    deleting = asyncio.create_task(handlers.job_status_changed(failed, cluster, locks=locks))
    # the deletion waits at the lock (unlocked, it would have listed and deleted by then)
    await async_wait_until(lambda: deleting.done() or locks.asked > asked, what="the deletion")
    cluster.go.set()
    assert await replacing == "created train-1"
    assert sorted(await deleting) == ["train-0", "train-1", "train-2"]
    assert cluster.pods == {}
