"""Pods as the job controllers create them (the training operator's PyTorchJob, JobSet under a
Kubeflow Trainer TrainJob), AdmissionReviews of them, and a JSONPatch applier, for the
webhook's tests."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from aegis.platforms.kubernetes import webhook_identity as wi
from aegis.platforms.kubernetes import webhook_patch

Body = dict[str, Any]
PET_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_NNODES", "PET_NODE_RANK",
           "PET_MASTER_ADDR", "PET_MASTER_PORT")  # fmt: skip


def pytorchjob_pod(
    kind: str, index: int, job: str = "train", *, world: int = 3, with_master: bool = True
) -> Body:
    """The pod ``<job>-<kind>-<index>`` of a PyTorchJob, as the training operator makes it."""
    rank = 0 if kind == "master" else index + (1 if with_master else 0)
    addr = f"{job}-master-0" if with_master else f"{job}-worker-0"
    env = {"MASTER_ADDR": addr, "MASTER_PORT": "23456", "WORLD_SIZE": str(world),
           "RANK": str(rank), "PET_NNODES": str(world), "PET_NODE_RANK": str(rank),
           "PET_MASTER_ADDR": addr, "PET_MASTER_PORT": "23456",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": f"{job}-{kind}-{index}", "namespace": "ml",
            "labels": {webhook_patch.INJECT: "true", wi.KF_JOB: job, wi.KF_TYPE: kind,
                       wi.KF_INDEX: str(index), "training.kubeflow.org/operator-name":
                       "pytorchjob-controller"},
            "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                 "name": job, "uid": "uid-ptj", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{
                "name": "pytorch", "image": "pytorch/pytorch:2.4.0",
                "command": ["python", "-u"], "args": ["train.py", "--epochs", "3"],
                "env": [{"name": k, "value": v} for k, v in env.items()],
                "ports": [{"name": "pytorchjob-port", "containerPort": 23456}],
            }],
        },
    }  # fmt: skip


def pytorchjob(job: str = "train", *, workers: int = 2, with_master: bool = True) -> Body:
    """The PyTorchJob object (what the webhook reads to know whether it has a Master)."""
    template = {"spec": {"containers": [{"name": "pytorch", "image": "pytorch/pytorch:2.4.0"}]}}
    specs = {"Worker": {"replicas": workers, "template": template}}
    if with_master:
        specs["Master"] = {"replicas": 1, "template": template}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": job, "namespace": "ml", "uid": "uid-ptj"},
            "spec": {"pytorchReplicaSpecs": specs}}  # fmt: skip


def declare_pytorchjobs(emulator: Any, *jobs: Body) -> None:
    """kmock's emulator serves PyTorchJobs, holding ``jobs``."""
    verbs = {"get", "list", "watch", "create"}
    emulator.resources["kubeflow.org/v1/pytorchjobs"] = {
        "kind": "PyTorchJob", "singular": "pytorchjob", "namespaced": True, "verbs": verbs,
    }  # fmt: skip
    for job in jobs:
        emulator.objects["kubeflow.org/v1/pytorchjobs", "ml", job["metadata"]["name"]] = job


def jobset_pod(node: int, jobset: str = "llm", *, nodes: int = 2) -> Body:
    """A pod of a TrainJob's JobSet (replicated job ``node``, job 0): a generated name, empty at
    admission; the completion index in a label and an annotation."""
    job = f"{jobset}-node-0"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "generateName": f"{job}-{node}-", "namespace": "ml",
            "labels": {webhook_patch.INJECT: "true", wi.JS_NAME: jobset, wi.JS_RJOB: "node",
                       wi.JS_INDEX: "0", wi.JS_UID: "uid-js", wi.COMPLETION_INDEX: str(node),
                       "batch.kubernetes.io/job-name": job,
                       "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"},
            "annotations": {wi.COMPLETION_INDEX: str(node)},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": job,
                                 "uid": "uid-job", "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "spec": {
            "hostname": f"{job}-{node}", "subdomain": jobset, "restartPolicy": "OnFailure",
            "containers": [{
                "name": "node", "image": "pytorch/pytorch:2.4.0",
                "command": ["torchrun", "train.py"],
                "env": [
                    {"name": "PET_NNODES", "value": str(nodes)},
                    {"name": "PET_NPROC_PER_NODE", "value": "1"},
                    {"name": "PET_MASTER_ADDR", "value": f"{jobset}-node-0-0.{jobset}"},
                    {"name": "PET_MASTER_PORT", "value": "29400"},
                    {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath":
                     f"metadata.annotations['{wi.COMPLETION_INDEX}']"}}},
                ],
            }],
        },
    }  # fmt: skip


def review(pod: Body, *, namespace: str = "ml", uid: str | None = None) -> Body:
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid or str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace, "operation": "CREATE", "name": pod["metadata"].get("name", ""),
            "object": pod,
        },
    }  # fmt: skip


def apply_patch(doc: Body, patch: list[Body]) -> Body:
    """RFC 6902 ``add`` (what the webhook emits) on object members: adds or replaces."""
    out = copy.deepcopy(doc)
    for op in patch:
        assert op["op"] == "add", op
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        target = out
        for part in parents:
            target = target[part]
        target[last] = copy.deepcopy(op["value"])
    return out
