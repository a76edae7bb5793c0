"""``aegis webhook --make-cert`` against kmock's emulator: the TLS Secret made once and kept,
the certificate files written, the MutatingWebhookConfiguration's caBundle set (nothing else
of it changed), and a server on those files trusted through that caBundle under the Service's
DNS name."""

from __future__ import annotations

import base64
import copy
import ssl
import stat
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import yaml

from aegis.platforms.kubernetes import (
    cluster,
    webhook_cluster,
    webhook_patch,
    webhook_server,
    webhook_setup,
)
from tests import k8s_emulator
from tests.webhook_pods import pytorchjob_pod, review

pytestmark = pytest.mark.timeout(60)
DEPLOY = Path(__file__).parent.parent / "deploy"
MWC = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
Body = dict[str, Any]


def _declare(emulator: kmock.KubernetesEmulator) -> None:
    k8s_emulator.declare(emulator)
    verbs = {"get", "list", "patch", "create"}
    emulator.resources[MWC] = {
        "kind": "MutatingWebhookConfiguration", "singular": "mutatingwebhookconfiguration",
        "namespaced": False, "verbs": verbs,
    }  # fmt: skip


def _deployed_config() -> Body:
    docs = yaml.safe_load_all((DEPLOY / "webhook.yaml").read_text())
    found: Body = next(d for d in docs if d and d["kind"] == "MutatingWebhookConfiguration")
    return found


def _object(emulator: kmock.KubernetesEmulator, plural: str, name: str) -> Body:
    for (resource, _, found), obj in emulator.objects.items():
        if resource.plural == plural and found == name and not obj.deleted:
            raw: Body = obj.raw
            return raw
    raise AssertionError(f"no {plural} {name}")


async def test_make_cert_provisions_once_and_the_api_server_would_trust_it(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    _declare(kmock)
    deployed = _deployed_config()
    kmock.objects[MWC, None, deployed["metadata"]["name"]] = copy.deepcopy(deployed)
    api = webhook_cluster.WebhookCluster(cluster.load_config())
    settings = webhook_setup.CertSettings()
    first = await webhook_setup.make_cert(api, settings, tmp_path / "a")
    secret = _object(kmock, "secrets", settings.secret)
    assert secret["type"] == "kubernetes.io/tls"
    assert stat.S_IMODE((first / "tls.key").stat().st_mode) == 0o600
    # a second replica (or a restart) serves the very same certificate
    second = await webhook_setup.make_cert(api, settings, tmp_path / "b")
    assert (second / "tls.crt").read_bytes() == (first / "tls.crt").read_bytes()
    assert _object(kmock, "secrets", settings.secret) == secret
    patched = _object(kmock, "mutatingwebhookconfigurations", settings.webhook_config)
    [hook] = patched["webhooks"]
    ca = base64.b64decode(hook["clientConfig"].pop("caBundle"))
    assert ca == base64.b64decode(secret["data"]["ca.crt"])
    assert hook == deployed["webhooks"][0]  # nothing but the caBundle changed

    runner, port = await webhook_server.start(
        webhook_patch.WebhookSettings(), api, cert_file=first / "tls.crt",
        key_file=first / "tls.key", host="127.0.0.1", port=0,
    )  # fmt: skip
    try:
        context = ssl.create_default_context(cadata=ca.decode())
        service = hook["clientConfig"]["service"]
        host = f"{service['name']}.{service['namespace']}.svc"  # the name the API server uses
        url = f"https://127.0.0.1:{port}{service['path']}"
        pod = pytorchjob_pod("worker", 0)
        del pod["metadata"]["labels"][webhook_patch.INJECT]  # TLS is the point here
        body = review(pod, uid="u")
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, ssl=context, server_hostname=host, json=body) as resp,
        ):
            assert resp.status == 200
            assert (await resp.json())["response"] == {"uid": "u", "allowed": True}
    finally:
        await runner.cleanup()


async def test_make_cert_says_when_the_webhook_configuration_is_missing(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    _declare(kmock)
    api = webhook_cluster.WebhookCluster(cluster.load_config())
    with pytest.raises(LookupError, match="no MutatingWebhookConfiguration aegis-webhook"):
        await webhook_setup.make_cert(api, webhook_setup.CertSettings(), tmp_path / "c")
