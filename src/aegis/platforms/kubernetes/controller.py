"""The kopf operator: handlers registered on a registry of our own (no module globals).

- ``AegisJob`` created or resumed: token Secret, headless Service, one pod per worker;
- every ``AegisJob`` event: when the master has written ``Failed`` or ``should_quit``, delete
  every pod of the job;
- every event of a pod labelled ``aegis.dev/job``: an exit non-zero deletes the pod, and its
  deletion brings a replacement (kept off the ErrorNodes).

Pod creations of one job, and its deletion of them all, are serialised by a per-job lock
(``handlers.JobLocks``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from typing import Any

import kopf

from aegis.platforms.kubernetes import handlers, manifests

log = logging.getLogger(__name__)

ApiFactory = Callable[[], handlers.ClusterApi]


def build_registry(api: ApiFactory) -> kopf.OperatorRegistry:
    """The operator's handlers; ``api`` is called once, on the first handler call."""
    registry = kopf.OperatorRegistry()
    cache: list[handlers.ClusterApi] = []
    locks = handlers.JobLocks()  # a job's pod creations and deletions never interleave

    def cluster() -> handlers.ClusterApi:
        if not cache:
            cache.append(api())
        return cache[0]

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # kopf's own loaders read $KUBECONFIG when called (the client library at import).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.create(manifests.GROUP, manifests.VERSION, manifests.PLURAL, registry=registry)
    @kopf.on.resume(manifests.GROUP, manifests.VERSION, manifests.PLURAL, registry=registry)
    async def job_created(body: kopf.Body, **_: Any) -> None:
        # Returns nothing: kopf would store a result in the status, which the master owns.
        await handlers.job_created(body, cluster(), locks=locks)

    @kopf.on.event(manifests.GROUP, manifests.VERSION, manifests.PLURAL, registry=registry)
    async def job_event(type: str | None, body: kopf.Body, **_: Any) -> None:
        if type == "DELETED":
            locks.forget(body.get("metadata", {}).get("namespace", "default"),
                         body.get("metadata", {}).get("name", ""))  # fmt: skip
        else:
            await handlers.job_status_changed(body, cluster(), locks=locks)

    @kopf.on.event("", "v1", "pods", labels={manifests.LABEL_JOB: kopf.PRESENT}, registry=registry)
    async def pod_event(type: str | None, body: kopf.Body, **_: Any) -> None:
        await handlers.pod_changed(type, body, cluster(), locks=locks)

    return registry


def real_cluster() -> handlers.ClusterApi:
    from aegis.platforms.kubernetes import cluster

    return cluster.KubernetesCluster(cluster.load_config())


async def serve(
    registry: kopf.OperatorRegistry,
    *,
    namespaces: Collection[str] = (),
    standalone: bool = True,
    liveness: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    settings: kopf.OperatorSettings | None = None,
) -> None:
    await kopf.operator(
        registry=registry,
        settings=settings,
        namespaces=namespaces,
        clusterwide=not namespaces,
        standalone=standalone,
        liveness_endpoint=liveness,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


def run(*, namespaces: Collection[str], standalone: bool, liveness: str | None) -> None:
    api = real_cluster()  # now: without credentials, one line before kopf starts
    registry = build_registry(lambda: api)
    asyncio.run(serve(registry, namespaces=namespaces, standalone=standalone, liveness=liveness))
