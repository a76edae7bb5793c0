"""``aegis auth init --out DIR``: the NATS operator-mode authority of a deployment, made once.

Writes into DIR:

- ``auth.json`` (0600): the operator, system and account keys, what ``aegis master --auth-file``
  reads (every replica the same file; ``Authority.save``/``load``);
- ``nats-auth.conf``: the nats-server configuration fragment of operator mode (the ``operator``,
  ``system_account``, ``resolver`` and ``resolver_preload`` blocks: public JWTs, no key), which
  ``deploy/nats.yaml``'s ``nats.conf`` includes;
- ``aegis-auth.json`` (0600): both as Kubernetes objects (a ``List``) for ``kubectl apply -f``:
  the Secret
  ``aegis-auth`` (``auth.json``, mounted by the master only) and the ConfigMap ``aegis-nats-auth``
  (``nats-auth.conf``, mounted by the NATS servers).

Existing files are never replaced unless ``--force`` is given: new keys invalidate every
credential handed out and every running nats-server's configuration.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from aegis.adapters.nats_auth import Authority, write_secret
from aegis.cli import paths

AUTH_FILE = "auth.json"
NATS_FRAGMENT = "nats-auth.conf"
MANIFEST = "aegis-auth.json"
SECRET_NAME = "aegis-auth"
CONFIGMAP_NAME = "aegis-nats-auth"

auth_app = typer.Typer(help="The NATS authority of a deployment.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(auth_app, name="auth")


def manifests(authority: Authority, keys: str, namespace: str) -> dict[str, Any]:
    """The Secret (the keys) and the ConfigMap (nats-server's fragment) for ``deploy/``."""
    labels = {"app.kubernetes.io/part-of": "aegis"}
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
         "metadata": {"name": SECRET_NAME, "namespace": namespace, "labels": labels},
         "stringData": {AUTH_FILE: keys}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": CONFIGMAP_NAME, "namespace": namespace, "labels": labels},
         "data": {NATS_FRAGMENT: authority.server_config()}},
    ]}  # fmt: skip


@auth_app.command("init")
def init(
    out: Annotated[
        Path,
        typer.Option(help="The directory to write the files into.", callback=paths.made_dir),
    ],
    namespace: Annotated[
        str, typer.Option(help="The namespace of the Kubernetes objects (aegis-auth.json).")
    ] = "aegis-system",
    force: Annotated[bool, typer.Option(help="Replace existing files (new keys).")] = False,
) -> None:
    """Make new operator and account keys: auth.json, nats-auth.conf and aegis-auth.json."""
    paths = [out / name for name in (AUTH_FILE, NATS_FRAGMENT, MANIFEST)]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        print(f"aegis: error: {', '.join(existing)} already exist(s); keep them, or pass "
              "--force to make new keys (every nats-server and master must then be given them)",
              file=sys.stderr)  # fmt: skip
        raise typer.Exit(2)
    authority = Authority()
    auth_file, fragment, manifest = paths
    authority.save(auth_file)
    keys = auth_file.read_text()
    fragment.write_text(authority.server_config())
    write_secret(manifest, json.dumps(manifests(authority, keys, namespace), indent=2))
    print(f"wrote {auth_file} (0600), {fragment} and {manifest} (0600); "
          f"kubectl apply -f {manifest}")  # fmt: skip
