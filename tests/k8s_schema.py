"""Schema checks of Kubernetes manifests without an API server.

Built-in kinds are checked against the API models shipped in the official ``kubernetes``
client (its OpenAPI-generated types): every field must exist in the model (a typo is an
error), every value must have the model's type, and the client's own validation (required
fields, enums it knows) runs by deserialising. Custom resources are checked with jsonschema
against their CRD's ``openAPIV3Schema``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes import client

MODELS = {
    ("v1", "Namespace"): "V1Namespace",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Pod"): "V1Pod",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("apps/v1", "StatefulSet"): "V1StatefulSet",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "V1ClusterRole",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "V1ClusterRoleBinding",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "V1CustomResourceDefinition",
    ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration"): (
        "V1MutatingWebhookConfiguration"
    ),
}
_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,), "int": (int,), "bool": (bool,), "float": (int, float), "datetime": (str,),
    "date": (str,), "object": (object,), "bytes": (str,), "bytearray": (str,),
}  # fmt: skip


def render_kustomization(root: Path) -> list[dict[str, Any]]:
    """What ``kubectl apply -k`` would send (our kustomization only lists resources)."""
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unsupported = set(spec) - {"apiVersion", "kind", "resources"}
    assert not unsupported, f"the test renderer does not support {unsupported}"
    docs: list[dict[str, Any]] = []
    for name in spec["resources"]:
        docs += [d for d in yaml.safe_load_all((root / name).read_text()) if d]
    return docs


def check_model(value: Any, type_name: str, path: str = "$") -> list[str]:
    """Problems of ``value`` as an instance of the client's type ``type_name``."""
    if m := re.fullmatch(r"(?:list|List)\[(.+)\]", type_name):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [p for i, v in enumerate(value) for p in check_model(v, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"(?:dict\(str, |Dict\[str, )(.+)[)\]]", type_name):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        return [p for k, v in value.items() for p in check_model(v, m[1], f"{path}.{k}")]
    if type_name in _SCALARS:
        ok = isinstance(value, _SCALARS[type_name])
        return [] if ok else [f"{path}: expected {type_name}, got {value!r}"]
    model = getattr(client, type_name)
    if not isinstance(value, dict):
        return [f"{path}: expected a {type_name} mapping"]
    fields = {json_name: attr for attr, json_name in model.attribute_map.items()}
    problems = []
    for key, item in value.items():
        if key not in fields:
            problems.append(f"{path}.{key}: no such field in {type_name}")
            continue
        problems += check_model(item, model.openapi_types[fields[key]], f"{path}.{key}")
    return problems


def check_builtin(doc: dict[str, Any]) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in MODELS:
        return [f"unknown kind {key}"]
    problems = check_model(doc, MODELS[key])
    if not problems:  # the client's own validation: required fields and the like
        try:
            client.ApiClient()._ApiClient__deserialize(doc, MODELS[key])  # type: ignore[attr-defined]
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}: {exc}")
    return problems


def check_custom(doc: dict[str, Any], crd: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` when ``doc`` does not fit the CRD's schema."""
    version = doc["apiVersion"].split("/")[1]
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    jsonschema.validate({k: v for k, v in doc.items() if k not in ("apiVersion", "kind",
                         "metadata")}, schema["schema"]["openAPIV3Schema"])  # fmt: skip
