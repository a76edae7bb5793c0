"""``aegis webhook --make-cert``: the webhook's certificate with no extra controller.

Run as the webhook Deployment's init container: it makes a CA and a serving certificate for
the webhook's Service (``webhook_certs``) and stores them in a ``kubernetes.io/tls`` Secret,
unless that Secret exists (then its certificate is kept: every replica, and every restart,
serves the same one); writes the Secret's ``tls.crt`` / ``tls.key`` where the server reads
them; and puts its ``ca.crt`` in the ``caBundle`` of each webhook of the
MutatingWebhookConfiguration, so the API server trusts it. To renew: delete the Secret and
restart the Deployment.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aegis.platforms.kubernetes import webhook_certs, webhook_server

Body = dict[str, Any]


class CertApi(webhook_server.WebhookApi, Protocol):
    async def patch_webhook_ca(self, name: str, ca_bundle: bytes) -> int:
        """Set ``caBundle`` on every webhook of the MutatingWebhookConfiguration ``name``;
        return how many; raise ``LookupError`` when it does not exist."""
        ...


@dataclass(frozen=True, slots=True)
class CertSettings:
    namespace: str = "aegis-system"
    secret: str = "aegis-webhook-tls"
    service: str = "aegis-webhook"
    webhook_config: str = "aegis-webhook"


def tls_secret(settings: CertSettings, cert: webhook_certs.ServingCert) -> Body:
    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
        "metadata": {"name": settings.secret, "namespace": settings.namespace},
        "data": {"tls.crt": b64(cert.cert_pem), "tls.key": b64(cert.key_pem),
                 "ca.crt": b64(cert.ca_pem)},
    }  # fmt: skip


async def make_cert(api: CertApi, settings: CertSettings, cert_dir: Path) -> Path:
    """Ensure the Secret, write ``tls.crt`` and ``tls.key`` under ``cert_dir``, patch the
    caBundle; returns ``cert_dir``."""
    names = webhook_certs.service_names(settings.service, settings.namespace)
    await api.ensure_secret(settings.namespace, tls_secret(settings, webhook_certs.make(names)))
    stored = await api.get_secret(settings.namespace, settings.secret)
    parts = {k: webhook_server.secret_of(stored, k) for k in ("tls.crt", "tls.key", "ca.crt")}
    missing = sorted(k for k, v in parts.items() if not v)
    if missing:
        raise LookupError(
            f"Secret {settings.namespace}/{settings.secret} lacks {', '.join(missing)}: "
            "delete it and run --make-cert again"
        )
    cert_dir.mkdir(parents=True, exist_ok=True)
    (cert_dir / "tls.crt").write_bytes(parts["tls.crt"] or b"")
    key = cert_dir / "tls.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(parts["tls.key"] or b"")
    await api.patch_webhook_ca(settings.webhook_config, parts["ca.crt"] or b"")
    return cert_dir
