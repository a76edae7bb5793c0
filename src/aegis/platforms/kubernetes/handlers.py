"""What the operator does, as plain async functions over the ``ClusterApi`` port.

Who creates deletes: the operator creates and deletes the pods (and the job's token Secret); the
master only writes the AegisJob's status. The operator reacts to that status (delete every pod
when the job failed or was stopped) and to pod exits (a pod that exited non-zero while the job
goes on is recreated, kept off the ErrorNodes by node affinity).
"""

from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Mapping
from typing import Any, Protocol

from aegis.platforms.kubernetes import manifests

log = logging.getLogger(__name__)

Body = dict[str, Any]


class ClusterApi(Protocol):
    async def list_pods(self, namespace: str, job: str) -> list[Body]: ...

    async def create_pod(self, namespace: str, body: Body) -> None: ...

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Delete; a pod that is already gone is not an error."""
        ...

    async def get_job(self, namespace: str, name: str) -> Body | None: ...

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        """Create the Secret unless it exists (its content is then kept)."""
        ...

    async def ensure_service(self, namespace: str, body: Body) -> None: ...


def token_secret(job: manifests.JobView) -> Body:
    token = base64.b64encode(secrets.token_urlsafe(24).encode()).decode()
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": f"{job.name}-aegis-token", "namespace": job.namespace,
                     "labels": {manifests.LABEL_JOB: job.name},
                     "ownerReferences": [_owner(job)]},
        "data": {"token": token},
    }  # fmt: skip


def headless_service(job: manifests.JobView) -> Body:
    """``<job>-0.<job>`` resolves to rank 0's pod: MASTER_ADDR of the rendezvous."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": job.name, "namespace": job.namespace,
                     "labels": {manifests.LABEL_JOB: job.name},
                     "ownerReferences": [_owner(job)]},
        "spec": {"clusterIP": "None", "selector": {manifests.LABEL_JOB: job.name},
                 "ports": [{"name": "rendezvous", "port": manifests.RENDEZVOUS_PORT}]},
    }  # fmt: skip


def _owner(job: manifests.JobView) -> Body:
    return {
        "apiVersion": f"{manifests.GROUP}/{manifests.VERSION}", "kind": manifests.KIND,
        "name": job.name, "uid": job.uid, "controller": True, "blockOwnerDeletion": True,
    }  # fmt: skip


async def job_created(
    body: Mapping[str, Any], api: ClusterApi, *, gone: str | None = None
) -> list[str]:
    """Create (idempotently) the token Secret, the headless Service and every missing pod;
    return the names of the pods created. Also the resume handler. The job is read afresh
    (the event's body may predate the master's latest ErrorNodes)."""
    meta = body.get("metadata") or {}
    fresh = await api.get_job(meta.get("namespace", "default"), meta["name"])
    if fresh is None:
        return []
    job = manifests.view(fresh)
    if job.over:
        return []
    await api.ensure_secret(job.namespace, token_secret(job))
    await api.ensure_service(job.namespace, headless_service(job))
    existing = {p["metadata"]["name"] for p in await api.list_pods(job.namespace, job.name)}
    existing.discard(gone or "")  # its DELETED event is the truth, whatever a lagging list says
    created = []
    for rank in range(job.replicas):
        name = manifests.pod_name(job.name, rank)
        if name not in existing:
            await api.create_pod(job.namespace, manifests.pod_manifest(job, rank))
            created.append(name)
    if created:
        log.info("job %s/%s: created pods %s", job.namespace, job.name, ", ".join(created))
    return created


async def job_status_changed(body: Mapping[str, Any], api: ClusterApi) -> list[str]:
    """Failed or stopped: delete every pod of the job; return the names deleted."""
    job = manifests.view(body)
    if not job.failed_or_stopped:
        return []
    deleted = []
    for pod in await api.list_pods(job.namespace, job.name):
        if not (pod.get("metadata") or {}).get("deletionTimestamp"):
            await api.delete_pod(job.namespace, pod["metadata"]["name"])
            deleted.append(pod["metadata"]["name"])
    if deleted:
        log.warning("job %s/%s %s: deleted pods %s", job.namespace, job.name,
                    job.phase or "stopped", ", ".join(deleted))  # fmt: skip
    return deleted


async def pod_changed(event: str | None, pod: Mapping[str, Any], api: ClusterApi) -> str | None:
    """A pod of a running job exited non-zero (1: its node is bad; 75: restart the container;
    anything else: it was lost): delete it. Once it is gone (``DELETED``), create its
    replacement, kept off the job's ErrorNodes. Return what was done, for the log and tests."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    job_name, rank = labels.get(manifests.LABEL_JOB), labels.get(manifests.LABEL_RANK)
    code = manifests.exit_code(pod)
    gone = event == "DELETED"
    if job_name is None or rank is None or (not gone and not code):
        return None
    namespace = meta.get("namespace", "default")
    body = await api.get_job(namespace, job_name)
    if body is None:
        return None  # the job is gone; owner references delete the pods
    job = manifests.view(body)
    if job.over:
        return None
    if gone:
        created = await job_created(body, api, gone=meta.get("name"))
        return f"created {created[0]}" if created else None
    log.warning("job %s/%s: %s exited %s on %s; replacing it (error nodes: %s)",
                namespace, job_name, meta.get("name"), code,
                (pod.get("spec") or {}).get("nodeName", "?"),
                ", ".join(job.error_nodes) or "none")  # fmt: skip
    if not meta.get("deletionTimestamp"):
        await api.delete_pod(namespace, meta["name"])
    return f"deleted {meta['name']}"
