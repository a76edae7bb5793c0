"""Who a pod of a job controller is, from what its controller wrote (no I/O).

The master names a job's pods ``<job>-<rank>`` (``core.model.pod_names``: a replacement keeps
its name), so a wrapped pod's Aegis name is that, whatever its Kubernetes name. The rank comes
from the controller's labels and its job object, never from the pod's own name (JobSet's pods
have generated names, empty at admission) nor from anything else the pod's author wrote
(``AEGIS_*`` or ``MASTER_ADDR`` env, ``aegis.dev/*`` annotations):

- ``PyTorchJob`` ``x`` (``training.kubeflow.org/job-name``, ``replica-type``,
  ``replica-index``): ``x-master-0`` is rank 0 and ``x-worker-i`` rank ``i + 1``; in a job
  with no Master replica (read from the PyTorchJob itself, whose uid must be the pod's
  controller's) ``x-worker-i`` is rank ``i``;
- ``JobSet`` ``x`` under a Kubeflow Trainer ``TrainJob`` (``jobset.sigs.k8s.io/jobset-name``,
  ``replicatedjob-name``, ``job-index``, ``batch.kubernetes.io/job-completion-index``): the
  replicated job ``node`` (the Trainer's torch runtime: one Indexed Job of ``numNodes`` pods)
  is the training; pod ``c`` of its job 0 is rank ``c``. The pods of its other replicated jobs
  (initializers) are not wrapped. A JobSet that runs ``node`` as several jobs is refused.

The pod must be controlled by the object its labels name (``ownerReferences``). A wrapped
pod's bootstrap secret is derived from its Aegis name, so a replacement of the same rank is
the same pod to Aegis, as with an ``AegisJob``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aegis.core.errors import AegisError
from aegis.core.model import POD_NAME_MAX, name_problem

KF_JOB = "training.kubeflow.org/job-name"
KF_TYPE = "training.kubeflow.org/replica-type"
KF_INDEX = "training.kubeflow.org/replica-index"
JS_NAME = "jobset.sigs.k8s.io/jobset-name"
JS_RJOB = "jobset.sigs.k8s.io/replicatedjob-name"
JS_INDEX = "jobset.sigs.k8s.io/job-index"
JS_UID = "jobset.sigs.k8s.io/jobset-uid"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
TRAINING_RJOB = "node"  # the Trainer's torch runtime's replicated job
PYTORCHJOB_API = ("kubeflow.org", "v1", "pytorchjobs")
JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")


@dataclass(frozen=True, slots=True)
class Identity:
    """A wrapped pod as Aegis knows it: ``pod`` is its name to the master."""

    namespace: str
    job: str
    pod: str  # ``<job>-<rank>``, as the master names it
    rank: int
    owner: Mapping[str, Any]  # the owner reference of the pod's Secrets (the job's object)
    source: str  # the controller's name for it: ``x-worker-0``, ``x-node-0-3``


class IdentityError(AegisError, ValueError):
    """The pod's controller labels do not name one pod of one job."""


class NotTrainingError(AegisError):
    """A pod of the job that is no training rank (a JobSet's initializer): left as it is."""


def jobset_of(pod: Mapping[str, Any]) -> str | None:
    """The JobSet this pod belongs to (its label), or None: the webhook reads it for the nodes
    its replacements keep off (the master's status annotation on it)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    found = labels.get(JS_NAME) if isinstance(labels, Mapping) else None
    return found if isinstance(found, str) and found else None


def pytorchjob_of(pod: Mapping[str, Any]) -> str | None:
    """The PyTorchJob whose spec ``of_pod`` needs for this pod (its ranks), or None."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    found = labels.get(KF_JOB) if isinstance(labels, Mapping) and KF_TYPE in labels else None
    return found if isinstance(found, str) and found else None


def has_master(job: Mapping[str, Any] | None, controller_uid: str) -> bool:
    """Whether the PyTorchJob has a Master replica; it must be the pod's controller."""
    if job is None:
        raise IdentityError("its PyTorchJob was not found")
    if (job.get("metadata") or {}).get("uid") != controller_uid:
        raise IdentityError("its PyTorchJob is not the pod's controller (another uid)")
    specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return any(str(k).lower() == "master" for k in specs)


def of_pod(
    pod: Mapping[str, Any], namespace: str, *, job: Mapping[str, Any] | None = None
) -> Identity:
    """The identity of a controller's pod (``job``: its PyTorchJob, for a PyTorchJob's pod);
    raises ``IdentityError`` saying what is missing, ``NotTrainingError`` for a pod to leave."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise IdentityError("metadata.labels is not a mapping")
    if KF_TYPE in labels:
        found = _pytorchjob(pod, labels, namespace, job)
    elif JS_NAME in labels:
        found = _jobset(pod, labels, namespace)
    else:
        raise IdentityError(
            f"no job controller's labels ({KF_TYPE} of a PyTorchJob, {JS_NAME} of a JobSet/"
            "TrainJob): only the pods of those controllers can be wrapped"
        )
    for kind, name, limit in (("namespace", namespace, 63), ("job", found.job, 63),
                              ("pod", found.pod, POD_NAME_MAX)):  # fmt: skip
        problem = name_problem(kind, name, limit)
        if problem is not None:
            raise IdentityError(problem)
    return found


def _pytorchjob(
    pod: Mapping[str, Any],
    labels: Mapping[str, Any],
    namespace: str,
    body: Mapping[str, Any] | None,
) -> Identity:
    job = _label(labels, KF_JOB)
    kind = _label(labels, KF_TYPE).lower()
    index = _index(labels, KF_INDEX)
    if kind not in ("master", "worker"):
        raise IdentityError(f"{KF_TYPE} {kind!r}: a PyTorchJob's replicas are master or worker")
    owner = _controller(pod, "PyTorchJob", job)
    with_master = has_master(body, owner.get("uid", ""))
    if kind == "master" and (index or not with_master):
        raise IdentityError(f"{job}-master-{index}: the PyTorchJob has no such master")
    rank = 0 if kind == "master" else index + (1 if with_master else 0)
    return Identity(namespace, job, f"{job}-{rank}", rank, owner, f"{job}-{kind}-{index}")


def _jobset(pod: Mapping[str, Any], labels: Mapping[str, Any], namespace: str) -> Identity:
    job, rjob = _label(labels, JS_NAME), _label(labels, JS_RJOB)
    if rjob != TRAINING_RJOB:
        raise NotTrainingError(f"replicated job {rjob!r} is not the training ({TRAINING_RJOB!r})")
    job_index = _index(labels, JS_INDEX)
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    completion = _index({**annotations, **labels}, COMPLETION_INDEX)
    _controller(pod, "Job", f"{job}-{rjob}-{job_index}")
    if job_index:
        raise IdentityError(
            f"job {job_index} of replicated job {rjob!r}: only a JobSet that runs it as one "
            "Indexed Job (replicas: 1, as a TrainJob does) is supported"
        )
    uid = str(labels.get(JS_UID, ""))
    owner = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": job, "uid": uid}
    return Identity(namespace, job, f"{job}-{completion}", completion, owner if uid else {},
                    f"{job}-{rjob}-{job_index}-{completion}")  # fmt: skip


def _label(labels: Mapping[str, Any], key: str) -> str:
    value = labels.get(key)
    if not isinstance(value, str) or not value:
        raise IdentityError(f"label {key} is missing")
    return value


def _index(values: Mapping[str, Any], key: str) -> int:
    value = values.get(key)
    if not isinstance(value, str) or not value.isdigit() or not value.isascii():
        raise IdentityError(f"{key} is {value!r}, not a non-negative integer")
    return int(value)


def _controller(pod: Mapping[str, Any], kind: str, name: str) -> Mapping[str, Any]:
    """The pod's controller reference, which must be the ``kind`` named ``name``."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            if ref.get("kind") == kind and ref.get("name") == name:
                return {k: ref[k] for k in ("apiVersion", "kind", "name", "uid") if k in ref}
            break
    raise IdentityError(f"the pod is not controlled by the {kind} {name!r} its labels name")
