"""The real ``ClusterApi`` (the operator's) and ``JobsApi`` (the master's): the official
``kubernetes`` client (blocking calls in a thread)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any, cast

from kubernetes import client, config
from kubernetes.client import exceptions as k8s_errors

from aegis.core.errors import SetupError
from aegis.platforms.kubernetes import manifests
from aegis.wire.logsafe import one_line

Body = dict[str, Any]

_NOT_FOUND, _CONFLICT = 404, 409
# On a node Aegis cordoned (``aegis ctl drain`` with ``--cordon-drained``): only such a cordon
# is lifted by ``aegis ctl undrain``, by this master or the next.
CORDONED_BY_AEGIS = "aegis.dev/cordoned"


def load_config() -> client.ApiClient:
    """In a pod: the service account; elsewhere: ``$KUBECONFIG`` or ``~/.kube/config``. Neither
    is a ``SetupError`` saying so."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except config.ConfigException as in_pod:
        path = os.environ.get("KUBECONFIG")  # read now, not at the client's import
        try:
            config.load_kube_config(config_file=path, client_configuration=configuration)  # type: ignore[no-untyped-call]
        except Exception as exc:  # the user's file: its parser raises anything
            where = f"$KUBECONFIG={path}" if path else "~/.kube/config"
            raise SetupError(
                f"no Kubernetes credentials: not in a pod ({in_pod}) and no usable kubeconfig "
                f"({where}: {one_line(str(exc))})"
            ) from None
    return client.ApiClient(configuration)


class KubernetesCluster:
    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def _plain(self, obj: object) -> Body:
        return cast(Body, self.api_client.sanitize_for_serialization(obj))  # type: ignore[no-untyped-call]

    async def list_pods(self, namespace: str, job: str) -> list[Body]:
        selector = f"{manifests.LABEL_JOB}={job}"
        found = await asyncio.to_thread(
            self.core.list_namespaced_pod, namespace, label_selector=selector
        )
        pods = [self._plain(p) for p in found.items]
        # Filter again: a label selector is a hint some API servers (and mocks) ignore.
        return [p for p in pods if p["metadata"].get("labels", {}).get(manifests.LABEL_JOB) == job]

    async def create_pod(self, namespace: str, body: Body) -> bool:
        try:
            await asyncio.to_thread(
                self.core.create_namespaced_pod, namespace, cast(Any, body), _preload_content=False
            )
        except k8s_errors.ApiException as exc:
            if exc.status != _CONFLICT:
                raise
            return False  # already there: a retried create, or another handler's
        return True

    async def delete_pod(self, namespace: str, name: str) -> None:
        try:
            await asyncio.to_thread(
                self.core.delete_namespaced_pod, name, namespace, _preload_content=False
            )
        except k8s_errors.ApiException as exc:
            if exc.status != _NOT_FOUND:
                raise

    async def get_job(self, namespace: str, name: str) -> Body | None:
        try:
            found = await asyncio.to_thread(
                self.custom.get_namespaced_custom_object,
                manifests.GROUP, manifests.VERSION, namespace, manifests.PLURAL, name,
            )  # fmt: skip
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return None
            raise
        return cast(Body, found)

    async def list_jobs(self, namespaces: Sequence[str]) -> list[Body]:
        group, version, plural = manifests.GROUP, manifests.VERSION, manifests.PLURAL
        if not namespaces:
            found = await asyncio.to_thread(
                self.custom.list_cluster_custom_object, group, version, plural
            )
            return list(cast(Body, found).get("items", []))
        jobs: list[Body] = []
        for namespace in namespaces:
            found = await asyncio.to_thread(
                self.custom.list_namespaced_custom_object, group, version, namespace, plural
            )
            jobs.extend(cast(Body, found).get("items", []))
        return jobs

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        try:
            found = await asyncio.to_thread(self.core.read_namespaced_secret, name, namespace)
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return None
            raise
        return self._plain(found)

    async def patch_job_status(self, namespace: str, name: str, status: Body) -> None:
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            manifests.GROUP, manifests.VERSION, namespace, manifests.PLURAL, name,
            {"status": status},
        )  # fmt: skip

    async def cordon_node(self, node: str) -> bool:
        found = self._plain(await asyncio.to_thread(self.core.read_node, node))
        ours = (found.get("metadata", {}).get("annotations") or {}).get(CORDONED_BY_AEGIS)
        if found.get("spec", {}).get("unschedulable"):
            return ours == "true"  # someone else's cordon is not ours to lift
        await self._patch_node(node, unschedulable=True, mark="true")
        return True

    async def uncordon_node(self, node: str) -> None:
        try:
            found = self._plain(await asyncio.to_thread(self.core.read_node, node))
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return  # the node is gone: no cordon left to lift
            raise
        if (found.get("metadata", {}).get("annotations") or {}).get(CORDONED_BY_AEGIS):
            await self._patch_node(node, unschedulable=False, mark=None)

    async def _patch_node(self, node: str, *, unschedulable: bool, mark: str | None) -> None:
        patch = {"metadata": {"annotations": {CORDONED_BY_AEGIS: mark}},
                 "spec": {"unschedulable": unschedulable}}  # fmt: skip
        await asyncio.to_thread(self.core.patch_node, node, patch, _preload_content=False)

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        await self._ensure(self.core.create_namespaced_secret, namespace, body)

    async def ensure_service(self, namespace: str, body: Body) -> None:
        await self._ensure(self.core.create_namespaced_service, namespace, body)

    async def _ensure(self, create: Any, namespace: str, body: Body) -> None:
        try:
            await asyncio.to_thread(create, namespace, body, _preload_content=False)
        except k8s_errors.ApiException as exc:
            if exc.status != _CONFLICT:
                raise
