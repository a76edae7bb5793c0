"""``aegis webhook``: the mutating admission webhook that wraps the pods of ``PyTorchJob``s and
``TrainJob``s (JobSets) opted in with ``aegis.dev/inject: "true"`` by the agent.

``aegis webhook --make-cert --cert-dir D`` (the Deployment's init container) provisions the
serving certificate and the webhook configuration's caBundle, then exits; ``aegis webhook
--cert-dir D`` serves HTTPS until interrupted. Both need the ``kubernetes`` extra; without it
they say which pip command brings it, in one line, and exit 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from aegis.cli import operator_cmd
from aegis.platforms.kubernetes import manifests

if TYPE_CHECKING:
    from aiohttp import web


def register(app: typer.Typer) -> None:
    app.command("webhook")(webhook)


# The options of ``aegis webhook``, one alias each, so the command's function stays short.
CertDir = Annotated[
    Path, typer.Option(help="Where tls.crt and tls.key are (written by --make-cert).")
]
MakeCert = Annotated[
    bool, typer.Option("--make-cert", help="Provision the certificate and caBundle, exit.")
]
Host = Annotated[str, typer.Option(help="Address to listen on.")]
Port = Annotated[int, typer.Option(min=0, max=65535, help="HTTPS port.")]
Master = Annotated[str, typer.Option(help="The master the agents talk to.")]
AgentImage = Annotated[str, typer.Option(help="The image the init container copies Aegis from.")]
TlsCaConfigmap = Annotated[
    str, typer.Option(help="ConfigMap with the ca.crt the agents trust (none: plain).")
]
Namespace = Annotated[str, typer.Option(help="The webhook's namespace.")]
Service = Annotated[str, typer.Option(help="The webhook's Service.")]
Secret = Annotated[str, typer.Option(help="The TLS Secret.")]
WebhookConfig = Annotated[
    str, typer.Option(help="The MutatingWebhookConfiguration to give the caBundle.")
]


def webhook(  # noqa: PLR0913 (a typer command: one parameter per option)
    cert_dir: CertDir = Path("/var/run/aegis-webhook"),
    make_cert: MakeCert = False,
    host: Host = "0.0.0.0",
    port: Port = 8443,
    master: Master = manifests.DEFAULT_MASTER,
    agent_image: AgentImage = manifests.DEFAULT_AGENT_IMAGE,
    tls_ca_configmap: TlsCaConfigmap = "",
    namespace: Namespace = "aegis-system",
    service: Service = "aegis-webhook",
    secret: Secret = "aegis-webhook-tls",
    webhook_config: WebhookConfig = "aegis-webhook",
) -> None:
    """Wrap opted-in PyTorchJob/TrainJob pods by the agent (needs the 'kubernetes' extra)."""
    try:
        from aegis.platforms.kubernetes import (
            cluster,
            webhook_cluster,
            webhook_patch,
            webhook_server,
            webhook_setup,
        )
    except ModuleNotFoundError as exc:
        _missing(exc)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    api = webhook_cluster.WebhookCluster(cluster.load_config())
    if make_cert:
        certs = webhook_setup.CertSettings(namespace, secret, service, webhook_config)
        asyncio.run(webhook_setup.make_cert(api, certs, cert_dir))
        return
    settings = webhook_patch.WebhookSettings(master, agent_image, tls_ca_configmap)
    started = webhook_server.start(
        settings, api, cert_file=cert_dir / "tls.crt", key_file=cert_dir / "tls.key",
        host=host, port=port,
    )  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(started))


def _missing(exc: ModuleNotFoundError) -> NoReturn:
    """Without the kubernetes extra: which pip command brings it, in one line; exit 2."""
    root = (exc.name or "").partition(".")[0]
    if root in ("cryptography", "aiohttp"):  # the same extra brings them
        hint = f"the webhook needs {root} (not installed): {operator_cmd.KUBERNETES_EXTRA}"
        print(f"aegis: error: {hint}", file=sys.stderr)
        raise typer.Exit(2) from None
    operator_cmd.missing_extra("the webhook", exc)


async def _serve(started: Coroutine[Any, Any, tuple[web.AppRunner, int]]) -> None:
    """Serve HTTPS (once ``started``) until cancelled."""
    runner, _ = await started
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
