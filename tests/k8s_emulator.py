"""kmock's Kubernetes emulator set up for Aegis: the resources kopf and the master use, the
``ml`` namespace, and a kubeconfig pointing at the emulator."""

from __future__ import annotations

from pathlib import Path

import kmock
import pytest

from aegis.platforms.kubernetes import manifests

JOBS = f"/apis/{manifests.GROUP}/{manifests.VERSION}/namespaces/ml/{manifests.PLURAL}"
PODS = "/api/v1/namespaces/ml/pods"
SECRETS = "/api/v1/namespaces/ml/secrets"
NODES = "/api/v1/nodes"


def declare(emulator: kmock.KubernetesEmulator) -> None:
    verbs = {"list", "watch", "get", "create", "patch", "update", "delete"}
    for plural, kind in (("namespaces", "Namespace"), ("nodes", "Node")):
        emulator.resources[f"v1/{plural}"] = {"kind": kind, "singular": kind.lower(),
                                              "namespaced": False, "verbs": verbs}  # fmt: skip
    for plural, kind in (("pods", "Pod"), ("secrets", "Secret"), ("services", "Service"),
                         ("events", "Event")):  # fmt: skip
        emulator.resources[f"v1/{plural}"] = {"kind": kind, "singular": kind.lower(),
                                              "namespaced": True, "verbs": verbs}  # fmt: skip
    emulator.resources[f"{manifests.GROUP}/{manifests.VERSION}/{manifests.PLURAL}"] = {
        "kind": manifests.KIND, "singular": "aegisjob", "namespaced": True, "verbs": verbs,
        "subresources": {"status"},
    }  # fmt: skip
    emulator.objects["v1/namespaces", None, "ml"] = {"metadata": {"name": "ml"}}


def use_kubeconfig(
    emulator: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: self\n"
        f"clusters: [{{name: self, cluster: {{server: '{emulator.url!s}'}}}}]\n"
        "contexts: [{name: self, context: {cluster: self, user: self}}]\n"
        "users: [{name: self, user: {token: test}}]\n"
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
