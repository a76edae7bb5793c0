"""Which pod the master's Kubernetes side waits for, and when it is back (pure: the master's
record of the job and the pods' bodies in, decisions out; ``master_side`` does the I/O).

A pod the master replaces or evicts is in ``Restarting`` (not finished) in the record; the
operator (or the controller of a wrapped job) recreates it. The side remembers the uid of the
pod there when the master decided (``uid_replaced``), and announces a pod as back once a live,
scheduled pod of that name with another uid is there (``back``); after a takeover the uid is
unknown and a pod created no earlier than the decision counts.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from aegis.core.phases import Phase
from aegis.platforms.kubernetes import manifests


def waiting(record: Mapping[str, Any]) -> list[str]:
    """The pods the master waits to see replaced (``Restarting``, not finished)."""
    return [
        name for name, info in record["status"]["pod_infos"].items()
        if info["inner_phase"] == Phase.RESTARTING.value and not info["finished"]
    ]  # fmt: skip


def uid_replaced(record: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], pod: str) -> str:
    """The uid of the pod named ``pod`` there now, to be replaced ("": none, or it already is
    the replacement: created in a second after the decision's, as when a new leader re-asks).
    A pod created in the decision's own second is the one replaced (a pod that failed at once):
    the operator replaces a pod only once the side has listed it, after this call."""
    current = pod_named(pods, pod)
    if current is None or is_replacement(current, "", decided_ts(record, pod), same_second=False):
        return ""
    return uid(current)


def back(
    record: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    awaiting: Mapping[str, str],
    announced: Collection[tuple[str, str]],
) -> list[tuple[str, Mapping[str, Any]]]:
    """The awaited pods whose replacement is there and not yet announced, with its body."""
    found = []
    for name, old in awaiting.items():
        pod = pod_named(pods, name)
        if pod is None or not is_replacement(pod, old, decided_ts(record, name)):
            continue
        if (name, uid(pod)) not in announced:
            found.append((name, pod))
    return found


def pod_named(pods: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    for pod in pods:
        if (pod.get("metadata") or {}).get("name") == name:
            return pod
    return None


def uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def decided_ts(record: Mapping[str, Any], pod: str) -> float:
    info = record["status"]["pod_infos"].get(pod) or {}
    return float(info.get("updated_ts") or 0.0)


def is_replacement(
    pod: Mapping[str, Any], old_uid: str, decided: float, *, same_second: bool = True
) -> bool:
    """A live, scheduled pod that is not the one being replaced: another uid, or (the uid
    replaced unknown) created no earlier than the master's decision (creationTimestamp has
    one-second resolution: ``same_second`` says whether one created in the decision's own
    second counts)."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if meta.get("deletionTimestamp") or not spec.get("nodeName"):
        return False
    if manifests.exit_code(pod) is not None:
        return False
    if old_uid:
        return uid(pod) != old_uid
    created = _parse_time(str(meta.get("creationTimestamp") or ""))
    if created is None:
        return False
    return created >= math.floor(decided) if same_second else created > math.floor(decided)


def _parse_time(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
