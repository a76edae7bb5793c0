"""The master's view of the jobs whose pods the admission webhook wraps (no I/O).

A ``PyTorchJob`` or a ``JobSet`` (a Kubeflow Trainer ``TrainJob``'s) whose pod templates carry
``aegis.dev/inject: "true"`` is followed by the master as an ``AegisJob`` is
(``wrapped_source``): these functions turn the controller's objects into what the master's
Kubernetes side reads, and its status back into what the webhook reads:

- the job: an AegisJob-shaped body (``as_aegisjob``): ``replicas`` is Master + Worker replicas
  of a PyTorchJob, the ``parallelism`` of a JobSet's replicated job ``node``; ``max_retry`` is
  the job's annotation ``aegis.dev/max-retry`` (default 3, as an AegisJob's); its status is the
  job's annotation ``aegis.dev/status`` (JSON: what an AegisJob's ``.status`` holds);
- the pods: those labelled ``aegis.dev/wrapped-job``, named to the master by
  ``aegis.dev/wrapped-rank`` (``<job>-<rank>``, ``as_aegis_pods``); the controller's own name is
  kept in the annotation ``aegis.dev/source-name`` (what is deleted to replace the pod);
- the replacement: the pods the status lists under ``replacing`` are deleted (``to_delete``) and
  the controller recreates them; the webhook adds node affinity away from the status's
  ErrorNodes and drained nodes to the new pod (``avoided``, ``with_avoided``);
- the end: the controller's ``Failed`` condition (or the job deleted) ends the master's job
  (``controller_failed``); success comes from the agents, as for an AegisJob.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from aegis.platforms.kubernetes import manifests, webhook_identity, webhook_patch

Body = dict[str, Any]

PYTORCHJOB = webhook_identity.PYTORCHJOB_API  # (group, version, plural)
JOBSET = webhook_identity.JOBSET_API
STATUS = "aegis.dev/status"
MAX_RETRY = "aegis.dev/max-retry"
SOURCE_NAME = "aegis.dev/source-name"
DEFAULT_MAX_RETRY = 3
HOSTNAME = "kubernetes.io/hostname"


def kind_of(body: Mapping[str, Any]) -> str:
    """``PyTorchJob`` or ``JobSet``; raises ``ValueError`` for anything else."""
    kind = str(body.get("kind", ""))
    if kind not in ("PyTorchJob", "JobSet"):
        raise ValueError(f"a {kind or 'object'} is not a PyTorchJob or a JobSet")
    return kind


def _templates(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = body.get("spec") or {}
    if kind_of(body) == "PyTorchJob":
        replicas = (spec.get("pytorchReplicaSpecs") or {}).values()
        return [r.get("template") or {} for r in replicas if isinstance(r, Mapping)]
    return [((r.get("template") or {}).get("spec") or {}).get("template") or {}
            for r in spec.get("replicatedJobs") or [] if isinstance(r, Mapping)]  # fmt: skip


def opted_in(body: Mapping[str, Any]) -> bool:
    """Whether a pod template of the job carries the webhook's opt-in label or annotation."""
    return any(webhook_patch.opted_in(t) for t in _templates(body))


def worker_num(body: Mapping[str, Any]) -> int:
    """The pods of the training: raises ``ValueError`` saying why there is no such number."""
    spec = body.get("spec") or {}
    if kind_of(body) == "PyTorchJob":
        specs = spec.get("pytorchReplicaSpecs") or {}
        roles = ("master", "worker")
        total = sum(int(r.get("replicas", 1)) for k, r in specs.items()
                    if str(k).lower() in roles and isinstance(r, Mapping))  # fmt: skip
    else:
        training = webhook_identity.TRAINING_RJOB
        node = [r for r in spec.get("replicatedJobs") or []
                if isinstance(r, Mapping) and r.get("name") == training]  # fmt: skip
        if len(node) != 1:
            raise ValueError(f"no replicated job {webhook_identity.TRAINING_RJOB!r}")
        if int(node[0].get("replicas", 1)) != 1:
            raise ValueError("replicated job 'node' must run as one Indexed Job (replicas: 1)")
        job_spec = (node[0].get("template") or {}).get("spec") or {}
        total = int(job_spec.get("parallelism", job_spec.get("completions", 1)))
    if total < 1:
        raise ValueError(f"{total} training pods: a job needs at least one")
    return total


def max_retry(body: Mapping[str, Any]) -> int:
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(MAX_RETRY)
    if raw is None:
        return DEFAULT_MAX_RETRY
    if not str(raw).isdigit():
        raise ValueError(f"annotation {MAX_RETRY} is {raw!r}, not a non-negative integer")
    return int(str(raw))


def status_of(body: Mapping[str, Any]) -> Body:
    """The status the master wrote in the annotation ({} when none, or not JSON)."""
    raw = ((body.get("metadata") or {}).get("annotations") or {}).get(STATUS)
    try:
        found = json.loads(raw) if raw else {}
    except (TypeError, json.JSONDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


def as_aegisjob(body: Mapping[str, Any]) -> Body:
    """The AegisJob-shaped body the master's side reads; raises ``ValueError`` on a job it
    cannot follow (no count of training pods, a bad annotation)."""
    meta = body.get("metadata") or {}
    return {
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace", "default"),
                     "uid": meta.get("uid", "")},
        "spec": {"replicas": worker_num(body), "max_retry": max_retry(body)},
        "status": status_of(body),
    }  # fmt: skip


def controller_failed(body: Mapping[str, Any]) -> str | None:
    """The controller's reason when it has failed the job (condition ``Failed`` True)."""
    for cond in (body.get("status") or {}).get("conditions") or []:
        if not isinstance(cond, Mapping):
            continue
        if cond.get("type") == "Failed" and str(cond.get("status")) == "True":
            why = cond.get("message") or cond.get("reason") or "failed"
            return f"the {kind_of(body)} failed: {why}"
    return None


def rank_of(pod: Mapping[str, Any], job: str) -> int | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    rank = str(labels.get(webhook_patch.LABEL_RANK, ""))
    if labels.get(webhook_patch.LABEL_JOB) != job or not rank.isdigit():
        return None
    return int(rank)


def as_aegis_pods(job: str, pods: Iterable[Mapping[str, Any]]) -> list[Body]:
    """The job's wrapped pods under the master's names (``<job>-<rank>``), live ones first (a
    terminating pod and its replacement share the name), the controller's name annotated."""
    out: list[Body] = []
    for pod in pods:
        rank = rank_of(pod, job)
        if rank is None:
            continue
        renamed = copy.deepcopy(dict(pod))
        meta = renamed.setdefault("metadata", {})
        meta["annotations"] = {**(meta.get("annotations") or {}), SOURCE_NAME: meta.get("name")}
        meta["name"] = manifests.pod_name(job, rank)
        out.append(renamed)
    out.sort(key=lambda p: bool((p.get("metadata") or {}).get("deletionTimestamp")))
    return out


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the side writes) applied to ``target``."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def to_delete(status: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """The controller's names of the pods to delete: each listed in ``replacing`` with the uid
    it has now (a replacement has another uid), not terminating already."""
    wanted = {str(k): str(v) for k, v in (status.get("replacing") or {}).items() if v}
    names = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if wanted.get(str(meta.get("name"))) == meta.get("uid") and not meta.get(
            "deletionTimestamp"
        ):
            names.append(str((meta.get("annotations") or {}).get(SOURCE_NAME, meta.get("name"))))
    return names


def started(job: Mapping[str, Any] | None) -> bool:
    """Whether the master has taken the job past Pending (``manifests.started``)."""
    return manifests.started(str(status_of(job or {}).get("phase") or ""))


def avoided(job: Mapping[str, Any] | None) -> list[str]:
    """The nodes a new pod of the job keeps off: its ErrorNodes and drained nodes."""
    status = status_of(job or {})
    names = set()
    for key in ("error_nodes", "drained_nodes"):
        for entry in status.get(key) or []:
            if isinstance(entry, Mapping) and entry.get("node"):
                names.add(str(entry["node"]))
    return sorted(names)


def with_avoided(affinity: Mapping[str, Any] | None, nodes: Sequence[str]) -> Body:
    """``affinity`` with a ``NotIn`` of ``nodes`` added to every required node selector term
    (terms are ORed: each must keep off them); the pod's own terms and other parts kept."""
    out: Body = copy.deepcopy(dict(affinity or {}))
    if not nodes:
        return out
    away = manifests.avoid_nodes(nodes)["nodeAffinity"]
    required_away = away["requiredDuringSchedulingIgnoredDuringExecution"]
    expression = required_away["nodeSelectorTerms"][0]["matchExpressions"][0]
    node_affinity = out.setdefault("nodeAffinity", {})
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or []), expression]
    required["nodeSelectorTerms"] = terms
    return out
