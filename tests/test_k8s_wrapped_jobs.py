"""The decisions of the master's webhook-wrapped job source (``wrapped_jobs``), tested directly:
a PyTorchJob's or JobSet's spec, pods to the master's names, the status annotation, the pods to
delete, and the node affinity the webhook adds to a replacement."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aegis.platforms.kubernetes import crd_status, manifests, webhook_patch, wrapped_jobs
from tests.webhook_pods import pytorchjob

Body = dict[str, Any]


def _opted(job: Body) -> Body:
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["metadata"] = {"labels": {webhook_patch.INJECT: "true"}}
    return job


def jobset(parallelism: int = 4, *, replicas: int = 1, label: bool = True) -> Body:
    node_template = {"metadata": {"labels": {webhook_patch.INJECT: "true"} if label else {}},
                     "spec": {"containers": [{"name": "node"}]}}  # fmt: skip
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": {"name": "llm", "namespace": "ml", "uid": "uid-js"},
        "spec": {"replicatedJobs": [
            {"name": "initializer", "template": {"spec": {"template": {"spec": {}}}}},
            {"name": "node", "replicas": replicas, "template": {"spec": {
                "parallelism": parallelism, "completions": parallelism,
                "template": node_template}}},
        ]},
    }  # fmt: skip


def test_a_pytorchjob_counts_master_and_workers_and_takes_max_retry_from_its_annotation() -> None:
    job = _opted(pytorchjob(workers=3))
    job["metadata"]["annotations"] = {wrapped_jobs.MAX_RETRY: "5"}
    assert wrapped_jobs.opted_in(job)
    body = wrapped_jobs.as_aegisjob(job)
    assert body["spec"] == {"replicas": 4, "max_retry": 5}
    spec = crd_status.job_spec(body)
    assert (spec.job, spec.namespace, spec.worker_num, spec.max_retry) == ("train", "ml", 4, 5)
    no_master = _opted(pytorchjob(workers=2, with_master=False))
    assert wrapped_jobs.worker_num(no_master) == 2
    assert wrapped_jobs.max_retry(no_master) == wrapped_jobs.DEFAULT_MAX_RETRY


def test_a_job_without_the_label_is_not_followed() -> None:
    assert not wrapped_jobs.opted_in(pytorchjob())
    assert not wrapped_jobs.opted_in(jobset(label=False))


def test_a_jobset_counts_the_parallelism_of_its_node_job() -> None:
    assert wrapped_jobs.opted_in(jobset())
    assert wrapped_jobs.worker_num(jobset(3)) == 3
    with pytest.raises(ValueError, match="one Indexed Job"):
        wrapped_jobs.worker_num(jobset(replicas=2))
    other = jobset()
    other["spec"]["replicatedJobs"] = other["spec"]["replicatedJobs"][:1]
    with pytest.raises(ValueError, match="no replicated job 'node'"):
        wrapped_jobs.worker_num(other)


@pytest.mark.parametrize("raw", ["-1", "two", "1.5"])
def test_a_bad_max_retry_annotation_is_refused_with_its_name(raw: str) -> None:
    job = _opted(pytorchjob())
    job["metadata"]["annotations"] = {wrapped_jobs.MAX_RETRY: raw}
    with pytest.raises(ValueError, match=wrapped_jobs.MAX_RETRY):
        wrapped_jobs.as_aegisjob(job)


def test_an_object_of_another_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="not a PyTorchJob or a JobSet"):
        wrapped_jobs.worker_num({"kind": "Deployment"})


def test_the_status_annotation_round_trips_and_a_bad_one_reads_as_none() -> None:
    job = pytorchjob()
    assert wrapped_jobs.status_of(job) == {}
    job["metadata"]["annotations"] = {wrapped_jobs.STATUS: json.dumps({"phase": "Running"})}
    assert wrapped_jobs.as_aegisjob(_opted(job))["status"] == {"phase": "Running"}
    job["metadata"]["annotations"] = {wrapped_jobs.STATUS: "{not json"}
    assert wrapped_jobs.status_of(job) == {}


def test_the_controller_failing_the_job_is_read_from_its_conditions() -> None:
    job = pytorchjob()
    assert wrapped_jobs.controller_failed(job) is None
    job["status"] = {"conditions": [
        {"type": "Running", "status": "False"},
        {"type": "Failed", "status": "True", "message": "backoff limit"},
    ]}  # fmt: skip
    assert wrapped_jobs.controller_failed(job) == "the PyTorchJob failed: backoff limit"
    job["status"]["conditions"][1]["status"] = "False"
    assert wrapped_jobs.controller_failed(job) is None


def pod(
    name: str, rank: int | None, uid: str, *, job: str = "train", deleting: bool = False
) -> Body:
    labels = {webhook_patch.LABEL_JOB: job}
    if rank is not None:
        labels[webhook_patch.LABEL_RANK] = str(rank)
    meta: Body = {"name": name, "uid": uid, "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": f"node-{uid}"}}


def test_pods_take_the_masters_names_by_rank_live_ones_first() -> None:
    pods = [pod("train-worker-0", 1, "old", deleting=True), pod("train-master-0", 0, "m"),
            pod("train-worker-0", 1, "new"), pod("other-worker-0", 1, "x", job="other"),
            pod("train-worker-9", None, "y")]  # fmt: skip
    named = wrapped_jobs.as_aegis_pods("train", pods)
    assert [(p["metadata"]["name"], p["metadata"]["uid"]) for p in named] == [
        ("train-0", "m"), ("train-1", "new"), ("train-1", "old")]  # fmt: skip
    assert named[1]["metadata"]["annotations"][wrapped_jobs.SOURCE_NAME] == "train-worker-0"
    spec = crd_status.job_spec(wrapped_jobs.as_aegisjob(_opted(pytorchjob(workers=1))))
    assert crd_status.scheduled_nodes(spec, named) == ["node-m", "node-new"]
    assert crd_status.scheduled_nodes(spec, named[:1]) is None  # rank 1 not there yet


def test_only_the_pod_listed_with_its_uid_is_deleted() -> None:
    named = wrapped_jobs.as_aegis_pods("train", [
        pod("train-master-0", 0, "m"), pod("train-worker-0", 1, "u1"),
        pod("train-worker-1", 2, "u2", deleting=True)])  # fmt: skip
    status = {"replacing": {"train-1": "u1", "train-2": "u2", "train-0": "someone-else"}}
    assert wrapped_jobs.to_delete(status, named) == ["train-worker-0"]
    assert wrapped_jobs.to_delete({"replacing": {}}, named) == []


def test_a_merge_patch_updates_the_annotations_status() -> None:
    before = {"phase": "Running", "replacing": {"train-1": "u1"}, "pod_infos": {"a": {"x": 1}}}
    after = wrapped_jobs.merge(
        before, {"replacing": {"train-1": None}, "pod_infos": {"a": {"y": 2}}}
    )
    assert after == {"phase": "Running", "replacing": {}, "pod_infos": {"a": {"x": 1, "y": 2}}}
    assert before["replacing"] == {"train-1": "u1"}  # not changed in place


def _annotated(status: Body) -> Body:
    job = pytorchjob()
    job["metadata"]["annotations"] = {wrapped_jobs.STATUS: json.dumps(status)}
    return job


def test_a_replacement_avoids_the_error_nodes_and_drained_nodes_of_the_status() -> None:
    job = _annotated({"error_nodes": [{"node": "node-b", "reason": "gpu"}],
                      "drained_nodes": [{"node": "node-z"}, {"node": "node-b"}]})  # fmt: skip
    assert wrapped_jobs.avoided(job) == ["node-b", "node-z"]
    assert wrapped_jobs.avoided(None) == [] and wrapped_jobs.avoided(pytorchjob()) == []
    assert wrapped_jobs.with_avoided(None, ["node-b"]) == manifests.avoid_nodes(["node-b"])
    assert wrapped_jobs.with_avoided({"podAffinity": {"x": 1}}, []) == {"podAffinity": {"x": 1}}


def test_the_pods_own_node_terms_each_keep_off_the_avoided_nodes() -> None:
    zone: Body = {"key": "zone", "operator": "In", "values": ["a"]}
    gpu: Body = {"key": "gpu", "operator": "Exists"}
    own: Body = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchExpressions": [gpu]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}}  # fmt: skip
    out = wrapped_jobs.with_avoided(own, ["node-b"])
    away = {"key": wrapped_jobs.HOSTNAME, "operator": "NotIn", "values": ["node-b"]}
    required = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == [
        {"matchExpressions": [zone, away]}, {"matchExpressions": [gpu, away]}]  # fmt: skip
    assert out["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 1}]  # fmt: skip
    terms = own["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0] == {"matchExpressions": [zone]}  # the pod's own kept
