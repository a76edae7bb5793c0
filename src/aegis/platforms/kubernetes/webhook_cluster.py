"""The webhook's ``CertApi`` over the official ``kubernetes`` client: the operator's adapter
(Secrets) and the MutatingWebhookConfiguration's ``caBundle``."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from kubernetes import client
from kubernetes.client import exceptions as k8s_errors

from aegis.platforms.kubernetes import cluster, webhook_identity

_NOT_FOUND = 404


class WebhookCluster(cluster.KubernetesCluster):
    def __init__(self, api_client: client.ApiClient) -> None:
        super().__init__(api_client)
        self.admission = client.AdmissionregistrationV1Api(api_client)

    async def get_pytorchjob(self, namespace: str, name: str) -> cluster.Body | None:
        return await self._get_job(webhook_identity.PYTORCHJOB_API, namespace, name)

    async def get_jobset(self, namespace: str, name: str) -> cluster.Body | None:
        return await self._get_job(webhook_identity.JOBSET_API, namespace, name)

    async def _get_job(
        self, api: tuple[str, str, str], namespace: str, name: str
    ) -> cluster.Body | None:
        group, version, plural = api
        try:
            found: Any = await asyncio.to_thread(
                self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
            )
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                return None
            raise
        return dict(found)

    async def patch_webhook_ca(self, name: str, ca_bundle: bytes) -> int:
        try:
            found: Any = await asyncio.to_thread(
                self.admission.read_mutating_webhook_configuration, name
            )
        except k8s_errors.ApiException as exc:
            if exc.status == _NOT_FOUND:
                raise LookupError(f"no MutatingWebhookConfiguration {name}") from None
            raise
        bundle = base64.b64encode(ca_bundle).decode()
        # Whole entries, not just the caBundle: a merge patch replaces the list as a whole.
        webhooks = [
            {**w, "clientConfig": {**w.get("clientConfig", {}), "caBundle": bundle}}
            for w in self._plain(found).get("webhooks") or []
        ]
        await asyncio.to_thread(
            self.admission.patch_mutating_webhook_configuration, name, {"webhooks": webhooks},
            _preload_content=False,
        )  # fmt: skip
        return len(webhooks)
