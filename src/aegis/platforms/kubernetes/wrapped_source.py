"""The master's second job source: PyTorchJobs and JobSets whose pods the webhook wraps.

``WrappedJobs`` is a ``master_side.JobsApi`` over those jobs (the decisions in
``wrapped_jobs``), so ``WrappedSide`` (a ``master_side.KubernetesSide``) follows them exactly
as it follows AegisJobs: a job's record is submitted once the webhook made its token Secret and
every rank's pod is scheduled; the record is mirrored into the job's annotation
``aegis.dev/status``; a pod the master replaces is deleted here (no operator: the controller
recreates it, the webhook wraps the new one away from the ErrorNodes) and announced back by its
rank when the replacement is scheduled. ``WrappedSide`` also ends the master's job (a ``quit``)
when the controller fails the job or the job is deleted.

A PyTorchJob or JobSet named as an AegisJob of its namespace is refused (they would share the
job key and token Secret): the AegisJob is followed, the other gets a status annotation that
says why. A cluster without the PyTorchJob or JobSet resource simply has no such jobs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any, cast

from kubernetes.client import exceptions as k8s_errors

from aegis.core.phases import TERMINAL_PHASES
from aegis.platforms.kubernetes import cluster, manifests, webhook_patch, wrapped_jobs
from aegis.platforms.kubernetes.master_side import KubernetesSide
from aegis.wire import platform_msgs as pm

log = logging.getLogger(__name__)

Body = dict[str, Any]
_NOT_FOUND, _FORBIDDEN = 404, 403
KINDS = (wrapped_jobs.PYTORCHJOB, wrapped_jobs.JOBSET)
_KIND_NAMES = {wrapped_jobs.PYTORCHJOB: "PyTorchJob", wrapped_jobs.JOBSET: "JobSet"}


class WrappedJobs:
    """``JobsApi`` over the webhook-wrapped jobs of the cluster."""

    def __init__(self, kube: cluster.KubernetesCluster) -> None:
        self.kube = kube
        self.kinds: dict[str, tuple[str, str, str]] = {}  # job key -> its resource
        self.failed: dict[str, str] = {}  # job key -> the controller's reason
        self._refused: set[str] = set()
        self._forbidden: set[tuple[str, str, str]] = set()  # said once

    async def _list(self, gvr: tuple[str, str, str], namespaces: Sequence[str]) -> list[Body]:
        group, version, plural = gvr
        custom = self.kube.custom
        try:
            if not namespaces:
                found = await asyncio.to_thread(
                    custom.list_cluster_custom_object, group, version, plural
                )
                return list(cast(Body, found).get("items", []))
            items: list[Body] = []
            for ns in namespaces:
                found = await asyncio.to_thread(
                    custom.list_namespaced_custom_object, group, version, ns, plural
                )
                items.extend(cast(Body, found).get("items", []))
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return []  # the resource is not installed: no such jobs
            if exc.status == _FORBIDDEN:  # the grant aegis-master-wrapped left out
                if gvr not in self._forbidden:
                    self._forbidden.add(gvr)
                    log.warning("kubernetes: not allowed to list %s (ClusterRole "
                                "aegis-master-wrapped): not following them", plural)  # fmt: skip
                return []
            raise
        return items

    async def list_jobs(self, namespaces: Sequence[str]) -> list[Body]:
        aegisjobs = {_key(j) for j in await self._list(_AEGISJOB, namespaces)}
        out: list[Body] = []
        self.failed.clear()
        for gvr in KINDS:
            for body in await self._list(gvr, namespaces):
                body.setdefault("kind", _KIND_NAMES[gvr])
                key = _key(body)
                if not wrapped_jobs.opted_in(body):
                    continue
                if key in aegisjobs:
                    await self._refuse(gvr, body, "an AegisJob of that name runs in the namespace")
                    continue
                try:
                    view = wrapped_jobs.as_aegisjob(body)
                except (ValueError, TypeError) as exc:
                    await self._refuse(gvr, body, str(exc))
                    continue
                self.kinds[key] = gvr
                reason = wrapped_jobs.controller_failed(body)
                if reason is not None:
                    self.failed[key] = reason
                out.append(view)
        return out

    async def _refuse(self, gvr: tuple[str, str, str], body: Body, why: str) -> None:
        key = _key(body)
        if key in self._refused:
            return
        self._refused.add(key)
        log.warning("kubernetes: %s %s refused: %s", body.get("kind"), key, why)
        meta = body["metadata"]
        await self._annotate(gvr, meta.get("namespace", "default"), meta["name"],
                             {"phase": "Failed", "message": f"refused: {why}"})  # fmt: skip

    async def _annotate(self, gvr: tuple[str, str, str], ns: str, name: str, status: Body) -> None:
        group, version, plural = gvr
        patch = {"metadata": {"annotations": {wrapped_jobs.STATUS: json.dumps(status)}}}
        await asyncio.to_thread(
            self.kube.custom.patch_namespaced_custom_object, group, version, ns, plural, name,
            patch,
        )  # fmt: skip

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        return await self.kube.get_secret(namespace, name)

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        found = await asyncio.to_thread(
            self.kube.core.list_namespaced_pod, namespace,
            label_selector=f"{webhook_patch.LABEL_JOB}={job}",
        )  # fmt: skip
        return wrapped_jobs.as_aegis_pods(job, [self.kube._plain(p) for p in found.items])

    async def patch_job_status(self, namespace: str, name: str, status: Body) -> None:
        """Merge ``status`` into the annotation, then delete the pods it lists as replacing."""
        gvr = self.kinds.get(f"{namespace}.{name}")
        if gvr is None:
            return
        group, version, plural = gvr
        try:
            body = await asyncio.to_thread(
                self.kube.custom.get_namespaced_custom_object, group, version, namespace,
                plural, name,
            )  # fmt: skip
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return  # deleted meanwhile
            raise
        full = wrapped_jobs.merge(wrapped_jobs.status_of(cast(Body, body)), status)
        await self._annotate(gvr, namespace, name, full)
        pods = await self.list_pods(namespace, name)
        for pod in wrapped_jobs.to_delete(full, pods):
            log.info("kubernetes: deleting pod %s/%s (the controller recreates it)", namespace, pod)
            await self.kube.delete_pod(namespace, pod)

    async def cordon_node(self, node: str) -> bool:
        return await self.kube.cordon_node(node)

    async def uncordon_node(self, node: str) -> None:
        await self.kube.uncordon_node(node)


_AEGISJOB = (manifests.GROUP, manifests.VERSION, manifests.PLURAL)


def _key(body: Body) -> str:
    meta = body.get("metadata") or {}
    return f"{meta.get('namespace', 'default')}.{meta.get('name')}"


class WrappedSide(KubernetesSide):
    """The side over ``WrappedJobs``: also ends the master's job when the controller failed the
    job or the job was deleted (the master's record not over yet)."""

    api: WrappedJobs

    def __init__(self, api: WrappedJobs, *args: Any, **kwargs: Any) -> None:
        super().__init__(api, *args, **kwargs)
        self.ended: set[str] = set()  # jobs a quit was sent for

    async def sync_once(self) -> None:
        before = set(self.jobs)
        await super().sync_once()
        if not self.leading():
            return
        for key in before - set(self.jobs):
            await self._quit(key, "the job was deleted")
        for key, reason in self.api.failed.items():
            await self._quit(key, reason)

    async def _quit(self, key: str, reason: str) -> None:
        if key in self.ended:
            return
        got = await self.store.get(key)
        if got is None:
            return
        record = json.loads(got[0])
        if record["status"]["phase"] in [p.value for p in TERMINAL_PHASES]:
            return
        if record["status"].get("should_quit"):
            return
        namespace, name = key.split(".", 1)
        log.warning("kubernetes: ending job %s: %s", key, reason)
        self.ended.add(key)  # once: the record says should_quit from then on
        event = pm.PlatformEvent(kind="quit", reason=reason)
        await self.bus.publish(pm.subject(namespace, name, "events"), self._encoder.encode(event))
