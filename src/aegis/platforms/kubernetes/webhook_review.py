"""``AdmissionReview`` v1 in and out of the webhook, as plain dicts (no I/O).

``request(review)`` reads what the API server sent (raising ``ReviewError`` with a readable
message when it is not an AdmissionReview v1 for the CREATE of a Pod); ``response`` answers
it: allowed with a base64 JSONPatch, or refused with a message the pod's creator sees (the
job controller records it as an event on its job: ``admission webhook ... denied the request:
aegis: cannot wrap this pod: ...``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aegis.core.errors import AegisError
from aegis.platforms.kubernetes import webhook_patch

API_VERSION = "admission.k8s.io/v1"
REFUSED_CODE = 403


class ReviewError(AegisError, ValueError):
    """Not an AdmissionReview this webhook can answer."""


@dataclass(frozen=True, slots=True)
class PodRequest:
    uid: str
    namespace: str
    pod: Mapping[str, Any]
    dry_run: bool = False  # nothing may be created for it (sideEffects: NoneOnDryRun)


def request(review: Any) -> PodRequest:
    if not isinstance(review, Mapping):
        raise ReviewError("the body is not a JSON object (an AdmissionReview)")
    if (review.get("apiVersion"), review.get("kind")) != (API_VERSION, "AdmissionReview"):
        raise ReviewError(
            f"expected apiVersion {API_VERSION} kind AdmissionReview, got "
            f"{review.get('apiVersion')!r} {review.get('kind')!r}"
        )
    req = review.get("request")
    if not isinstance(req, Mapping):
        raise ReviewError("the AdmissionReview has no request")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("the AdmissionReview's request has no uid")
    kind = req.get("kind") or {}
    if not isinstance(kind, Mapping) or (kind.get("group"), kind.get("kind")) != ("", "Pod"):
        raise ReviewError(f"request {uid}: the object is a {kind!r}, not a core/v1 Pod")
    if req.get("operation") != "CREATE":
        raise ReviewError(f"request {uid}: operation {req.get('operation')!r}, not CREATE")
    pod = req.get("object")
    if not isinstance(pod, Mapping):
        raise ReviewError(f"request {uid}: no object (the pod)")
    namespace = req.get("namespace") or (pod.get("metadata") or {}).get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ReviewError(f"request {uid}: no namespace")
    return PodRequest(uid, namespace, pod, dry_run=bool(req.get("dryRun", False)))


def response(uid: str, result: webhook_patch.MutationResult) -> dict[str, Any]:
    answer: dict[str, Any] = {"uid": uid, "allowed": result.allowed}
    if result.allowed and result.patch:
        answer["patchType"] = "JSONPatch"
        answer["patch"] = base64.b64encode(json.dumps(result.patch).encode()).decode()
    if not result.allowed:
        answer["status"] = {"code": REFUSED_CODE, "message": result.message}
    if result.warnings:
        answer["warnings"] = list(result.warnings)
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": answer}
