"""The admission webhook's HTTPS server (aiohttp): ``POST /mutate`` answers AdmissionReview v1,
``GET /healthz`` says it is up.

For a pod it wraps, the server first provisions that pod's bootstrap secret the way the
operator does for an ``AegisJob``'s pods (``handlers.pod_token_secret``): the job's Secret
``<job>-aegis-job-token`` (made once, a random token; the master reads it) and the pod's own
``<pod>-aegis-pod-token``, derived from it for the pod's identity (``wire.tokens.pod_token``),
both owned by the job's object so they go with it; one of either name owned by another object
is refused, never used. Only then is the pod allowed, mounting that one
Secret: a pod never starts without its secret, and holds no other pod's. When the Secrets
cannot be made the pod is refused (the controller retries the creation). A dry run (``kubectl
apply --dry-run=server``) gets the same answer and makes nothing.

A PyTorchJob's or a JobSet's pod is also kept off the nodes the master's status annotation on
the job names (its ErrorNodes and drained nodes, ``wrapped_jobs.avoided``): a ``NotIn`` node
affinity added to the pod's own (``wrapped_jobs.with_avoided``), so the replacement the
controller creates for a pod the master deleted lands elsewhere.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import secrets
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from aegis.platforms.kubernetes import (
    crd_status,
    manifests,
    webhook_identity,
    webhook_patch,
    webhook_review,
    wrapped_jobs,
)
from aegis.wire.tokens import pod_token

log = logging.getLogger(__name__)

Body = dict[str, Any]
MAX_BODY = 8 * 1024 * 1024  # the API server's own limit on an object is 3 MiB


class SecretsApi(Protocol):
    async def ensure_secret(self, namespace: str, body: Body) -> None:
        """Create the Secret unless it exists (its content is then kept)."""
        ...

    async def get_secret(self, namespace: str, name: str) -> Body | None: ...


class WebhookApi(SecretsApi, Protocol):
    async def get_pytorchjob(self, namespace: str, name: str) -> Body | None:
        """The PyTorchJob, None when there is none of that name."""
        ...

    async def get_jobset(self, namespace: str, name: str) -> Body | None:
        """The JobSet, None when there is none of that name."""
        ...


def _secret(who: webhook_identity.Identity, name: str, token: str) -> Body:
    meta: Body = {"name": name, "namespace": who.namespace,
                  "labels": {webhook_patch.LABEL_JOB: who.job}}  # fmt: skip
    if who.owner.get("uid"):
        meta["ownerReferences"] = [{**who.owner, "blockOwnerDeletion": False}]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta,
            "data": {"token": base64.b64encode(token.encode()).decode()}}  # fmt: skip


async def provision(api: SecretsApi, who: webhook_identity.Identity) -> None:
    """The job's Secret (once) and the pod's, derived from it; idempotent."""
    job_secret = crd_status.token_secret_name(who.job)
    made = await _ensure_owned(api, who, _secret(who, job_secret, secrets.token_urlsafe(24)))
    job_token = crd_status.token(made)
    if job_token is None:
        raise LookupError(f"{who.namespace}/{job_secret} holds no token")
    pod_secret = _secret(who, manifests.pod_token_secret_name(who.pod),
                         pod_token(job_token, who.namespace, who.job, who.pod))  # fmt: skip
    await _ensure_owned(api, who, pod_secret)


async def _ensure_owned(api: SecretsApi, who: webhook_identity.Identity, body: Body) -> Body | None:
    """Create the Secret unless it exists; the one stored, which must be the job's (an
    AegisJob's of the same name, or one left by a deleted job, is refused)."""
    await api.ensure_secret(who.namespace, body)
    found = await api.get_secret(who.namespace, body["metadata"]["name"])
    crd_status.check_owner(found, str(who.owner.get("uid", "")))
    return found


async def answer(
    review: Any, settings: webhook_patch.WebhookSettings, api: WebhookApi
) -> dict[str, Any]:
    """The AdmissionReview answering ``review``; raises ``ReviewError`` on a malformed one."""
    req = webhook_review.request(review)
    job = jobset = None
    opted = webhook_patch.opted_in(req.pod)
    name = webhook_identity.pytorchjob_of(req.pod) if opted else None
    set_name = webhook_identity.jobset_of(req.pod) if opted and name is None else None
    try:
        if name is not None:  # its ranks depend on whether the job has a Master replica
            job = await api.get_pytorchjob(req.namespace, name)
        elif set_name is not None:  # only for the nodes its replacements keep off
            jobset = await api.get_jobset(req.namespace, set_name)
    except Exception as exc:  # the API server's error: refuse, the controller retries
        what = f"PyTorchJob {name}" if name is not None else f"JobSet {set_name}"
        message = f"aegis: the {what} could not be read ({exc})"
        refused = webhook_patch.MutationResult(allowed=False, message=message)
        return webhook_review.response(req.uid, refused)
    read = job if job is not None else jobset  # its status: the master's annotation
    rejoin = wrapped_jobs.started(read)  # a pod made once the job runs: a replacement
    result = webhook_patch.mutate(req.pod, req.namespace, settings, job=job, rejoin=rejoin)
    avoid = wrapped_jobs.avoided(read)
    if result.identity is not None and avoid:  # a replacement: off the job's ErrorNodes
        affinity = wrapped_jobs.with_avoided((req.pod.get("spec") or {}).get("affinity"), avoid)
        op = {"op": "add", "path": "/spec/affinity", "value": affinity}
        result = dataclasses.replace(result, patch=[*result.patch, op])
    if result.identity is not None and not req.dry_run:
        who = result.identity
        try:
            await provision(api, who)
        except Exception as exc:  # the API server's error: refuse, the controller retries
            log.warning("pod %s/%s: its Secret could not be made: %s", who.namespace, who.pod,
                        exc)  # fmt: skip
            result = webhook_patch.MutationResult(
                allowed=False, message=f"aegis: the bootstrap secret of {who.pod} could not "
                f"be made ({exc}); the pod is refused rather than started without it")  # fmt: skip
        else:
            log.info("pod %s/%s (rank %d of %s): wrapped", who.namespace, who.pod, who.rank,
                     who.job)  # fmt: skip
    elif not result.allowed:
        log.warning("request %s in %s refused: %s", req.uid, req.namespace, result.message)
    return webhook_review.response(req.uid, result)


def app(settings: webhook_patch.WebhookSettings, api: WebhookApi) -> web.Application:
    async def mutate(request: web.Request) -> web.Response:
        try:
            review = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return web.Response(status=400, text=f"aegis webhook: the body is not JSON: {exc}\n")
        try:
            return web.json_response(await answer(review, settings, api))
        except webhook_review.ReviewError as exc:
            log.warning("malformed AdmissionReview refused: %s", exc)
            return web.Response(status=400, text=f"aegis webhook: {exc}\n")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    application = web.Application(client_max_size=MAX_BODY)
    application.router.add_post("/mutate", mutate)
    application.router.add_get("/healthz", healthz)
    return application


def tls_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


async def start(
    settings: webhook_patch.WebhookSettings,
    api: WebhookApi,
    *,
    cert_file: Path,
    key_file: Path,
    host: str,
    port: int,
) -> tuple[web.AppRunner, int]:
    """Serve until the runner is cleaned up; returns it and the port bound (``port`` 0: any)."""
    runner = web.AppRunner(app(settings, api), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls_context(cert_file, key_file))
    await site.start()
    bound = int(runner.addresses[0][1])  # the port bound (port 0: one the kernel chose)
    log.info("admission webhook on https://%s:%d/mutate", host, bound)
    return runner, bound


def secret_of(found: Mapping[str, Any] | None, key: str) -> bytes | None:
    """One key of a Secret as read from the API (``data``, base64), None when absent."""
    encoded = ((found or {}).get("data") or {}).get(key)
    return base64.b64decode(encoded) if encoded else None
