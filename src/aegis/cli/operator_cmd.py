"""``aegis operator``: the Kubernetes operator for ``AegisJob`` (kopf).

kopf and the Kubernetes client come with the ``kubernetes`` extra, not with ``pip install
aegis-ft``: without them the command (and the admission webhook, which needs the same) says
which pip command brings them, in one line, and exits 2.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Annotated, NoReturn

import typer

KUBERNETES_EXTRA = "pip install 'aegis-ft[kubernetes]'"
KUBERNETES_MODULES = frozenset({"kopf", "kubernetes"})  # what that extra installs


def register(app: typer.Typer) -> None:
    app.command("operator")(operator)


def missing_extra(what: str, exc: ModuleNotFoundError) -> NoReturn:
    """One line naming the pip command, exit 2; an import error of anything else is a bug of
    ours and is raised as it is."""
    root = (exc.name or "").partition(".")[0]
    if root not in KUBERNETES_MODULES:
        raise exc
    print(f"aegis: error: {what} needs {root} (not installed): {KUBERNETES_EXTRA}", file=sys.stderr)
    raise typer.Exit(2) from None


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

        importlib.import_module("kubernetes")  # now, not at the first event (as the handlers do)
    except ModuleNotFoundError as exc:
        missing_extra("the operator", exc)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    controller.run(namespaces=tuple(namespace or ()), standalone=standalone, liveness=liveness)
