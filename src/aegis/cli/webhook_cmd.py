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
from pathlib import Path
from typing import Annotated

import typer

from aegis.cli import operator_cmd
from aegis.platforms.kubernetes import manifests


def register(app: typer.Typer) -> None:
    app.command("webhook")(webhook)


def webhook(  # noqa: PLR0913 (a typer command: one parameter per option)
    cert_dir: Annotated[
        Path, typer.Option(help="Where tls.crt and tls.key are (written by --make-cert).")
    ] = Path("/var/run/aegis-webhook"),
    make_cert: Annotated[
        bool, typer.Option("--make-cert", help="Provision the certificate and caBundle, exit.")
    ] = False,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(min=0, max=65535, help="HTTPS port.")] = 8443,
    master: Annotated[str, typer.Option(help="The master the agents talk to.")] = (
        manifests.DEFAULT_MASTER
    ),
    agent_image: Annotated[
        str, typer.Option(help="The image the init container copies Aegis from.")
    ] = (manifests.DEFAULT_AGENT_IMAGE),
    tls_ca_configmap: Annotated[
        str, typer.Option(help="ConfigMap with the ca.crt the agents trust (none: plain).")
    ] = "",
    namespace: Annotated[str, typer.Option(help="The webhook's namespace.")] = "aegis-system",
    service: Annotated[str, typer.Option(help="The webhook's Service.")] = "aegis-webhook",
    secret: Annotated[str, typer.Option(help="The TLS Secret.")] = "aegis-webhook-tls",
    webhook_config: Annotated[
        str, typer.Option(help="The MutatingWebhookConfiguration to give the caBundle.")
    ] = "aegis-webhook",
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
        root = (exc.name or "").partition(".")[0]
        if root in ("cryptography", "aiohttp"):  # the same extra brings them
            hint = f"the webhook needs {root} (not installed): {operator_cmd.KUBERNETES_EXTRA}"
            print(f"aegis: error: {hint}", file=sys.stderr)
            raise typer.Exit(2) from None
        operator_cmd.missing_extra("the webhook", exc)
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

    async def serve() -> None:
        runner, _ = await webhook_server.start(
            settings, api, cert_file=cert_dir / "tls.crt", key_file=cert_dir / "tls.key",
            host=host, port=port,
        )  # fmt: skip
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
