"""What the operator does, as plain async functions over the ``ClusterApi`` port.

Who creates deletes: the operator creates and deletes the pods (and the job's token Secret); the
master only writes the AegisJob's status. The operator reacts to that status (delete every pod
when the job failed or was stopped) and to pod exits (a pod that exited non-zero while the job
goes on is recreated, kept off the ErrorNodes by node affinity).

kopf runs handlers at least once and concurrently (the creation and resume handlers of a job may
run twice, next to a pod's ``DELETED`` handler). So every creation of a job's pods runs under
that job's lock (``JobLocks``), and reads the job *after* it has seen which pods are missing: a
pod found gone was deleted before the job was read, so the replacement is placed with ErrorNodes
at least as new as its deletion (the master writes them before the pod exits). Reading the job
first made a late creation run place a replacement with the ErrorNodes of before the fault.
A ``DELETED`` pod brings exactly its own rank back (retried, idempotent on AlreadyExists).
Deleting every pod of a failed job takes the same lock, so no creation that read the job
before it failed ends after the deletion.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Mapping
from typing import Any, Protocol

from aegis.core.model import name_problem
from aegis.platforms.kubernetes import crd_status, manifests
from aegis.wire.tokens import pod_token

log = logging.getLogger(__name__)

Body = dict[str, Any]


class ClusterApi(Protocol):
    async def list_pods(self, namespace: str, job: str) -> list[Body]: ...

    async def create_pod(self, namespace: str, body: Body) -> bool:
        """Create the pod; False when a pod of that name already exists."""
        ...

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Delete; a pod that is already gone is not an error."""
        ...

    async def get_job(self, namespace: str, name: str) -> Body | None: ...

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        """Create the Secret unless it exists (its content is then kept)."""
        ...

    async def get_secret(self, namespace: str, name: str) -> Body | None: ...

    async def ensure_service(self, namespace: str, body: Body) -> None: ...


class JobLocks:
    """One lock per job: the operator's pod creations for a job, and its deletion of them
    all, never interleave."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def of(self, namespace: str, job: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, job), asyncio.Lock())

    def forget(self, namespace: str, job: str) -> None:
        self._locks.pop((namespace, job), None)


CREATE_ATTEMPTS = 4
CREATE_BACKOFF_S = 0.25


def token_secret(job: manifests.JobView) -> Body:
    """The job's secret: read by the master (and this operator) only, never mounted."""
    return _secret(job, crd_status.token_secret_name(job.name), secrets.token_urlsafe(24))


def pod_token_secret(job: manifests.JobView, rank: int, job_token: str) -> Body:
    """The one Secret the pod of ``rank`` mounts: its own bootstrap secret, derived from the
    job's (``wire.tokens.pod_token``), so no pod can speak for another."""
    pod = manifests.pod_name(job.name, rank)
    body = _secret(job, manifests.pod_token_secret_name(pod),
                   pod_token(job_token, job.namespace, job.name, pod))  # fmt: skip
    body["metadata"]["labels"][manifests.LABEL_RANK] = str(rank)
    return body


def _secret(job: manifests.JobView, name: str, token: str) -> Body:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": job.namespace,
                     "labels": {manifests.LABEL_JOB: job.name},
                     "ownerReferences": [_owner(job)]},
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }  # fmt: skip


async def _ensure_owned(api: ClusterApi, job: manifests.JobView, body: Body) -> Body | None:
    """Create the Secret unless it exists; the one stored, which must be this job's
    (``crd_status.SecretOwnerError`` otherwise: a 409 keeps another object's Secret)."""
    await api.ensure_secret(job.namespace, body)
    found = await api.get_secret(job.namespace, body["metadata"]["name"])
    crd_status.check_owner(found, job.uid)
    return found


async def _job_token(api: ClusterApi, job: manifests.JobView) -> str:
    """The job's secret, as stored (made now if the Secret is missing: idempotent)."""
    found = crd_status.token(await _ensure_owned(api, job, token_secret(job)))
    if found is None:
        raise LookupError(f"job {job.namespace}/{job.name}: its token Secret has no token")
    return found


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
    body: Mapping[str, Any], api: ClusterApi, *, locks: JobLocks | None = None
) -> list[str]:
    """Create (idempotently) the token Secret, the headless Service and every missing pod;
    return the names of the pods created. Also the resume handler."""
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", "default"), meta["name"]
    problem = name_problem("namespace", namespace) or name_problem("job", name)
    if problem is not None:  # Kubernetes allows dots in a name; Aegis's subjects do not
        log.warning("AegisJob %s/%s refused, no pods made: %s", namespace, name, problem)
        return []
    async with (locks or JobLocks()).of(namespace, name):
        fresh = await api.get_job(namespace, name)
        if fresh is None or manifests.view(fresh).over:
            return []
        job = manifests.view(fresh)
        await api.ensure_secret(job.namespace, token_secret(job))
        await api.ensure_service(job.namespace, headless_service(job))
        existing = {p["metadata"]["name"] for p in await api.list_pods(job.namespace, job.name)}
        missing = [r for r in range(job.replicas) if manifests.pod_name(name, r) not in existing]
        if not missing:
            return []
        # Read the job again, now that the pods are known missing (see the module's note).
        fresh = await api.get_job(namespace, name)
        if fresh is None or manifests.view(fresh).over:
            return []
        job = manifests.view(fresh)
        created = [
            manifests.pod_name(name, rank) for rank in missing if await _create(api, job, rank)
        ]
    if created:
        log.info("job %s/%s: created pods %s", namespace, name, ", ".join(created))
    return created


async def replace_rank(
    namespace: str, name: str, rank: int, api: ClusterApi, *, locks: JobLocks | None = None
) -> bool:
    """The pod of ``rank`` is gone: create its replacement, placed by the job as it is now.
    False when the job is over or gone, or another handler already put the pod back."""
    async with (locks or JobLocks()).of(namespace, name):
        body = await api.get_job(namespace, name)
        if body is None:
            return False  # the job is gone; owner references delete the pods
        job = manifests.view(body)
        if job.over or rank >= job.replicas:
            return False
        return await _create(api, job, rank)


async def _create(api: ClusterApi, job: manifests.JobView, rank: int) -> bool:
    """Create one pod (after its own token Secret), retrying a failed call (kopf does not
    retry an event handler)."""
    body = manifests.pod_manifest(job, rank)
    for attempt in range(CREATE_ATTEMPTS):
        try:
            await _ensure_owned(api, job, pod_token_secret(job, rank, await _job_token(api, job)))
            return await api.create_pod(job.namespace, body)
        except crd_status.SecretOwnerError:
            raise  # no retry makes it this job's
        except Exception as exc:
            if attempt == CREATE_ATTEMPTS - 1:
                raise
            log.warning("job %s/%s: creating %s failed (%s); retrying", job.namespace,
                        job.name, body["metadata"]["name"], exc)  # fmt: skip
            await asyncio.sleep(CREATE_BACKOFF_S * 2**attempt)
    return False


async def job_status_changed(
    body: Mapping[str, Any], api: ClusterApi, *, locks: JobLocks | None = None
) -> list[str]:
    """Failed or stopped: delete every pod of the job. Otherwise delete each pod the master
    waits to see replaced (``.status.replacing``: a lost pod, e.g. silent but not exited) if
    it is still the very pod named there (same uid); its deletion brings the replacement.
    Return the names deleted.

    Under the job's lock, like every creation: a replacement that read the job before it
    failed is made before the pods are listed here, so it is deleted with them (without the
    lock it came after the listing and outlived the job)."""
    job = manifests.view(body)
    if not job.failed_or_stopped and not job.replacing:
        return []
    async with (locks or JobLocks()).of(job.namespace, job.name):
        return await _delete_pods(api, job)


async def _delete_pods(api: ClusterApi, job: manifests.JobView) -> list[str]:
    deleted = []
    for pod in await api.list_pods(job.namespace, job.name):
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        name = meta["name"]
        lost = bool(meta.get("uid")) and job.replacing.get(name) == meta.get("uid")
        if job.failed_or_stopped or lost:
            await api.delete_pod(job.namespace, name)
            deleted.append(name)
    if deleted and job.failed_or_stopped:
        log.warning("job %s/%s %s: deleted pods %s", job.namespace, job.name,
                    job.phase or "stopped", ", ".join(deleted))  # fmt: skip
    elif deleted:
        log.warning("job %s/%s: deleted lost pods %s for their replacement", job.namespace,
                    job.name, ", ".join(deleted))  # fmt: skip
    return deleted


async def pod_changed(
    event: str | None, pod: Mapping[str, Any], api: ClusterApi, *, locks: JobLocks | None = None
) -> str | None:
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
    if gone:
        if await replace_rank(namespace, job_name, int(rank), api, locks=locks):
            log.info("job %s/%s: created %s", namespace, job_name, meta.get("name"))
            return f"created {meta.get('name')}"
        return None
    body = await api.get_job(namespace, job_name)
    if body is None:
        return None  # the job is gone; owner references delete the pods
    job = manifests.view(body)
    if job.over:
        return None
    log.warning("job %s/%s: %s exited %s on %s; replacing it (avoiding: %s)",
                namespace, job_name, meta.get("name"), code,
                (pod.get("spec") or {}).get("nodeName", "?"),
                ", ".join((*job.error_nodes, *job.drained_nodes)) or "none")  # fmt: skip
    if not meta.get("deletionTimestamp"):
        await api.delete_pod(namespace, meta["name"])
    return f"deleted {meta['name']}"
