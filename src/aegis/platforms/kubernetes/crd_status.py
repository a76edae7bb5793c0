"""The master's side of an ``AegisJob``, as plain dicts (no I/O): the job spec it reads from the
resource, the bootstrap token from the job's Secret, and the ``.status`` it writes back (the
job's status of DESIGN section 3, the user-facing line, and Kubernetes conditions).

Conditions (``type``: ``True`` when):
- ``Running``: the job trains (``RunCommand``);
- ``Recovering``: a fault is being handled (``Troubleshooting``, ``Restarting``);
- ``Succeeded``: the job ended ``Succeed``;
- ``Failed``: the job ended ``Failed``; reason ``BudgetExhausted`` (more faults than
  ``max_retry``), ``RepeatedFault`` (the same fault ``repeat_limit`` times in a row),
  ``Stopped`` (``aegis ctl stop``, a pod no node could take) or ``Failed``
  (:mod:`aegis.core.endings`); its message, and ``.status.ended``, say why in the master's words.
A condition's ``lastTransitionTime`` changes only when its ``status`` does.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aegis.core.errors import AegisError
from aegis.core.model import JobSpec
from aegis.core.phases import Phase
from aegis.platforms.kubernetes import manifests
from aegis.wire import job_summary

Body = dict[str, Any]

CONDITION_TYPES = ("Running", "Recovering", "Succeeded", "Failed")
_POD_FIELDS = ("pod_ip", "node", "inner_phase", "finished", "retries", "last_failed_reason",
               "updated_ts")  # fmt: skip


@dataclass(frozen=True, slots=True)
class DrainedNode:
    reason: str
    ts: float
    cordoned: bool = False  # Aegis cordoned it (and uncordons it on undrain)


def drained_nodes(status: Mapping[str, Any] | None) -> dict[str, DrainedNode]:
    """The drained nodes an AegisJob's status records (a new leader learns them back)."""
    found: dict[str, DrainedNode] = {}
    for entry in (status or {}).get("drained_nodes") or []:
        if isinstance(entry, Mapping) and entry.get("node"):
            found[str(entry["node"])] = DrainedNode(
                str(entry.get("reason", "")),
                float(entry.get("ts") or 0.0),
                bool(entry.get("cordoned", False)),
            )
    return found


def token_secret_name(job: str) -> str:
    """The job's Secret (``-job-``: never the name of a pod's, ``manifests.pod_token_secret_name``,
    which job ``train-1`` and pod 1 of job ``train`` would otherwise share)."""
    return f"{job}-aegis-job-token"


class SecretOwnerError(AegisError):
    """A Secret of the name Aegis gives a job's or a pod's token belongs to another object
    (an AegisJob and a PyTorchJob of one name, a job deleted and made again): its token is
    not used, nor one derived from it."""


def check_owner(secret: Mapping[str, Any] | None, uid: str) -> None:
    """Raises ``SecretOwnerError`` unless ``secret`` (when there is one) names ``uid`` among
    its owners; an empty ``uid`` (an owner not known) checks nothing."""
    if secret is None or not uid:
        return
    meta = secret.get("metadata") or {}
    owners = meta.get("ownerReferences") or []
    if any(isinstance(o, Mapping) and o.get("uid") == uid for o in owners):
        return
    found = [str(o.get("uid", ""))[:64] for o in owners if isinstance(o, Mapping)]
    raise SecretOwnerError(f"Secret {str(meta.get('name', '?'))[:253]} is owned by "
                           f"{found or 'nothing'}, not by {uid[:64]}: its token is not this "
                           "job's")  # fmt: skip


def job_spec(body: Mapping[str, Any]) -> JobSpec:
    """The master's spec of an AegisJob (raises ``ValueError`` on replicas < 1 or
    max_retry < 0; the CRD's schema already refuses them)."""
    job = manifests.view(body)
    return JobSpec(job=job.name, namespace=job.namespace, worker_num=job.replicas,
                   max_retry=job.max_retry)  # fmt: skip


def token(secret: Mapping[str, Any] | None) -> str | None:
    """The bootstrap token of a job's Secret (``data.token``, base64), None when absent."""
    if not secret:
        return None
    plain = (secret.get("stringData") or {}).get("token")
    if plain:
        return str(plain)
    encoded = (secret.get("data") or {}).get("token")
    if not encoded:
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def scheduled_nodes(spec: JobSpec, pods: Iterable[Mapping[str, Any]]) -> list[str] | None:
    """The node of each rank's pod, in rank order; None while a pod is missing or unscheduled
    (the master's first record names every pod's node)."""
    nodes: dict[str, str] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        if node and not meta.get("deletionTimestamp"):
            nodes[str(meta.get("name"))] = str(node)
    wanted = [manifests.pod_name(spec.job, rank) for rank in range(spec.worker_num)]
    if any(name not in nodes for name in wanted):
        return None
    return [nodes[name] for name in wanted]


def cr_status(
    record: Mapping[str, Any],
    previous: Sequence[Mapping[str, Any]] = (),
    *,
    now: str,
    replacing: Mapping[str, str] | None = None,
    drained: Mapping[str, DrainedNode] | None = None,
) -> Body:
    """The AegisJob ``.status`` for the master's record of the job. ``previous``: the
    conditions now on the resource; ``now``: RFC 3339 time of this write; ``replacing``: pods
    the master waits to see replaced, with the uid of the pod to be replaced; ``drained``: the
    nodes ``aegis ctl drain`` took out of service (the operator keeps pods off them, as off
    the ErrorNodes)."""
    summary = job_summary.from_record(dict(record))
    raw = record["status"]
    pods = {
        name: {k: info[k] for k in _POD_FIELDS if info.get(k) is not None}
        for name, info in raw["pod_infos"].items()
    }
    out: Body = {
        "phase": raw["phase"],
        "recover_count": raw["recover_count"],
        "should_quit": raw["should_quit"],
        "seq": raw["seq"],
        "restarted": summary.restarted,
        "hardware_rescheduled": summary.hardware_rescheduled,
        "message": summary.user_line,
        "ended": summary.ended,
        "pod_infos": pods,
        "error_nodes": [dict(e) for e in raw["error_nodes"]],
        "replacing": dict(replacing or {}),
        "drained_nodes": [
            {"node": node, "reason": d.reason, "ts": d.ts, "cordoned": d.cordoned}
            for node, d in sorted((drained or {}).items())
        ],
        "conditions": conditions(summary, previous, now),
    }
    return out


def conditions(
    summary: job_summary.Summary, previous: Sequence[Mapping[str, Any]], now: str
) -> list[Body]:
    before = {c.get("type"): c for c in previous}
    out = []
    for kind, holds, reason in _wanted(summary):
        status = "True" if holds else "False"
        old = before.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        message = summary.user_line if holds else ""
        if holds and kind == "Failed" and summary.ended:
            message = f"{summary.ended}; {message}"
        out.append({"type": kind, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": since or now})  # fmt: skip
    return out


def _wanted(summary: job_summary.Summary) -> list[tuple[str, bool, str]]:
    phase = summary.phase
    ending = summary.ending if phase is Phase.FAILED else None
    failed_reason = ending.value if ending is not None else phase.value
    return [
        ("Running", phase is Phase.RUN_COMMAND, phase.value),
        ("Recovering", phase in (Phase.TROUBLESHOOTING, Phase.RESTARTING), phase.value),
        ("Succeeded", phase is Phase.SUCCEED, phase.value),
        ("Failed", phase is Phase.FAILED, failed_reason),
    ]


def same_status(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal but for the conditions' times (no write needed)."""

    def strip(s: Mapping[str, Any]) -> Body:
        conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                 for c in s.get("conditions", [])]  # fmt: skip
        return {**s, "conditions": conds}

    return strip(a) == strip(b)


def merge_patch(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> Body:
    """The JSON merge patch (RFC 7386) that turns ``before`` into ``after`` for the maps of the
    status (``pod_infos``, ``replacing``): a key gone from a map is sent as null, or it would
    stay on the resource. Lists and scalars are replaced whole."""
    patch: Body = dict(after)
    for name, value in after.items():
        old = (before or {}).get(name)
        if isinstance(value, dict) and isinstance(old, Mapping):
            patch[name] = {**{k: None for k in old if k not in value}, **value}
    return patch


def rfc3339(ts: float) -> str:
    """A status's time (a condition's ``lastTransitionTime``): RFC 3339, whole seconds, UTC."""
    moment = datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).replace(microsecond=0)
    return moment.isoformat().replace("+00:00", "Z")
