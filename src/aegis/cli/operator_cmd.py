"""``aegis operator``: the Kubernetes operator for ``AegisJob`` (kopf)."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("operator")(operator)


def operator(
    namespace: Annotated[
        list[str] | None, typer.Option(help="Watch these namespaces (default: all).")
    ] = None,
    standalone: Annotated[bool, typer.Option(help="No peering (one operator replica).")] = True,
    liveness: Annotated[
        str | None, typer.Option(help="Liveness endpoint, e.g. http://0.0.0.0:8080/healthz.")
    ] = None,
) -> None:
    """Run the AegisJob operator until interrupted (needs the 'kubernetes' extra: kopf)."""
    try:
        from aegis.platforms.kubernetes import controller
    except ImportError as exc:
        print(f"aegis: error: the operator needs kopf ({exc})", file=sys.stderr)
        raise typer.Exit(2) from exc
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    controller.run(namespaces=tuple(namespace or ()), standalone=standalone, liveness=liveness)
