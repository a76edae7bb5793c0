"""deploy/: render the kustomization, schema-check every manifest, the example AegisJob and the
pods the operator would create from it."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shutil
import stat
import types
from pathlib import Path
from typing import Any

import jsonschema
import nats.errors
import pytest
import yaml

from aegis.adapters import nats_auth
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.checks import config as checks_config
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.kubernetes import crd_status, handlers, manifests
from tests import k8s_schema

DEPLOY = Path(__file__).parent.parent / "deploy"


def _crd() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load((DEPLOY / "crd.yaml").read_text())
    return crd


def _example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "examples" / "aegisjob.yaml").read_text())
    return doc


def test_every_rendered_manifest_fits_the_kubernetes_api_schema() -> None:
    docs = k8s_schema.render_kustomization(DEPLOY)
    kinds = sorted({d["kind"] for d in docs})
    assert {"CustomResourceDefinition", "Deployment", "StatefulSet", "ClusterRole"} <= set(kinds)
    for doc in docs:
        assert k8s_schema.check_builtin(doc) == [], doc["metadata"]["name"]


def test_the_deployment_runs_two_master_replicas_and_the_operator() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_schema.render_kustomization(DEPLOY)}
    assert docs[("Deployment", "aegis-master")]["spec"]["replicas"] == 2
    operator = docs[("Deployment", "aegis-operator")]["spec"]["template"]["spec"]
    assert operator["containers"][0]["command"][:2] == ["aegis", "operator"]
    assert docs[("StatefulSet", "aegis-nats")]["spec"]["replicas"] == 3


def test_schema_check_catches_a_misspelt_field() -> None:
    docs = k8s_schema.render_kustomization(DEPLOY)
    broken = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    broken["spec"]["replica"] = 2
    assert any("replica" in p for p in k8s_schema.check_builtin(broken))


def test_the_crd_has_a_status_subresource_and_printer_columns() -> None:
    version = _crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Recovered", "MaxRetry", "ErrorNodes"} <= columns
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"phase", "recover_count", "error_nodes", "conditions", "pod_infos"} <= set(status)


def test_the_example_aegisjob_fits_the_crd() -> None:
    k8s_schema.check_custom(_example(), _crd())


def test_an_aegisjob_without_replicas_is_rejected_by_the_crd() -> None:
    doc = _example()
    del doc["spec"]["replicas"]
    with pytest.raises(jsonschema.ValidationError):
        k8s_schema.check_custom(doc, _crd())


@pytest.mark.parametrize("mode", ["initContainer", "image"])
def test_operator_pods_fit_the_pod_schema_in_both_agent_modes(mode: str) -> None:
    doc = _example()
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["agent"]["mode"] = mode
    doc["status"] = {"phase": "Restarting", "error_nodes": [{"node": "gpu-node-7"}]}
    job = manifests.view(doc)
    for rank in range(job.replicas):
        assert k8s_schema.check_builtin(manifests.pod_manifest(job, rank)) == []
    assert k8s_schema.check_builtin(handlers.token_secret(job)) == []
    assert k8s_schema.check_builtin(handlers.headless_service(job)) == []


def test_spec_tls_ca_config_map_makes_every_agent_trust_that_ca_only() -> None:
    """TLS in a cluster (issue 20): ``spec.tls.caConfigMap`` names the CA's ConfigMap; each pod
    mounts it read-only and its agent gets ``--tls-ca`` on it (before the user's command).
    Without it the pods are as before."""
    doc = _example()
    doc["metadata"]["uid"] = "uid-1"
    doc["spec"]["tls"] = {"caConfigMap": "aegis-ca"}
    k8s_schema.check_custom(doc, _crd())
    job = manifests.view(doc)
    for rank in range(job.replicas):
        pod = manifests.pod_manifest(job, rank)
        assert k8s_schema.check_builtin(pod) == []
        main = pod["spec"]["containers"][0]
        agent = main["command"][: main["command"].index("--")]
        at = agent.index("--tls-ca")
        ca = Path(agent[at + 1])
        [mount] = [v for v in main["volumeMounts"] if v["name"] == manifests.CA_VOLUME]
        assert mount == {"name": "aegis-ca", "mountPath": str(ca.parent), "readOnly": True}
        assert ca.name == "ca.crt"
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == manifests.CA_VOLUME]
        assert volume["configMap"] == {"name": "aegis-ca"}
    doc["spec"]["tls"] = {"caConfigMap": 7}
    with pytest.raises(jsonschema.ValidationError):
        k8s_schema.check_custom(doc, _crd())
    del doc["spec"]["tls"]
    plain = manifests.pod_manifest(manifests.view(doc), 0)
    assert "--tls-ca" not in plain["spec"]["containers"][0]["command"]
    assert manifests.CA_VOLUME not in {v["name"] for v in plain["spec"]["volumes"]}


@pytest.mark.parametrize(
    "checks",
    [{"enabled": []}, {"enabled": ["disk"]}, {"budgets_s": {"io": 0}}, {"budgets_s": {"io": -5}}],
)
def test_the_crd_refuses_a_check_configuration_the_agent_would_refuse(
    checks: dict[str, Any],
) -> None:
    doc = _example()
    doc["spec"]["checks"] = checks
    with pytest.raises(jsonschema.ValidationError):
        k8s_schema.check_custom(doc, _crd())
    with pytest.raises(ValueError):
        checks_config.parse(checks)


def test_spec_checks_reach_every_pods_agent_as_its_check_configuration() -> None:
    doc = _example()
    doc["metadata"]["uid"] = "uid-1"
    job = manifests.view(doc)
    expected = checks_config.parse(doc["spec"]["checks"])
    assert expected.enabled is not None and len(expected.enabled) == 5
    for rank in range(job.replicas):
        main = manifests.pod_manifest(job, rank)["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in main["env"]}
        assert checks_config.from_env(env) == expected
    del doc["spec"]["checks"]
    main = manifests.pod_manifest(manifests.view(doc), 0)["spec"]["containers"][0]
    assert checks_config.ENV not in {e["name"] for e in main["env"]}  # none: the defaults


def test_the_status_the_master_writes_fits_the_crd() -> None:
    from tests.test_k8s_status import record_of, started

    record = record_of(started(), hardware_rescheduled=1)
    record["status"].update(phase="Failed", recover_count=3, should_quit=False)
    record["status"]["error_nodes"] = [{"node": "b", "reason": "gpu", "ts": 1.0}]
    doc = _example()
    doc["status"] = crd_status.cr_status(
        record, now="2026-01-01T00:00:00Z", replacing={"train-1": "uid-1"},
        drained={"c": crd_status.DrainedNode("maintenance", 2.0, cordoned=True)},
    )  # fmt: skip
    assert doc["status"]["drained_nodes"]
    k8s_schema.check_custom(doc, _crd())
    doc["status"]["conditions"][0]["status"] = "Maybe"
    with pytest.raises(jsonschema.ValidationError):
        k8s_schema.check_custom(doc, _crd())


def test_the_master_deployment_learns_jobs_from_kubernetes_and_listens_on_the_pod_ip() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_schema.render_kustomization(DEPLOY)}
    master = docs[("Deployment", "aegis-master")]["spec"]["template"]["spec"]["containers"][0]
    argv = master["command"]
    assert "--kubernetes" in argv
    # the pod's own IP (downward API), not 0.0.0.0
    assert (
        argv[argv.index("--grpc-host") + 1]
        == argv[argv.index("--metrics-host") + 1]
        == ("$(POD_IP)")
    )
    env = {e["name"]: e for e in master["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    rules = docs[("ClusterRole", "aegis-master")]["rules"]
    allowed = {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}
    # What platforms.kubernetes.master_side calls, and nothing that creates or deletes.
    assert {("aegisjobs", "list"), ("aegisjobs/status", "patch"), ("secrets", "get"),
            ("pods", "list")} <= allowed  # fmt: skip
    assert not {verb for _, verb in allowed} & {"create", "delete"}
    # Cordoning drained nodes is an opt-in grant (deploy/rbac-cordon.yaml + --cordon-drained).
    assert "--cordon-drained" not in argv
    assert ("ClusterRole", "aegis-master-cordon") not in docs
    optional = list(yaml.safe_load_all((DEPLOY / "rbac-cordon.yaml").read_text()))
    assert all(k8s_schema.check_builtin(doc) == [] for doc in optional)
    role, binding = optional
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert binding["subjects"][0]["name"] == "aegis-master"


# -- authentication on by default (issue 20, part 1) ---------------------------------------------


def _deployed() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in k8s_schema.render_kustomization(DEPLOY)}


def _mounted_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(the Secret a file of ``container`` comes from, its key) for an absolute ``path``."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            secret = volumes[mount["name"]]["secret"]["secretName"]
            return secret, path[len(mount["mountPath"].rstrip("/")) + 1 :]
    raise AssertionError(f"{path} is on no volume")


def test_the_masters_load_the_keys_aegis_auth_init_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aegis.cli import auth_cmd
    from aegis.cli.main import main

    # The account JWT in the server config carries its issue time, to the second: the config
    # written and the one made again below must be issued in the same second to compare equal.
    monkeypatch.setattr(nats_auth, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    pod = _deployed()[("Deployment", "aegis-master")]["spec"]["template"]["spec"]
    master = pod["containers"][0]
    argv = master["command"]
    assert "--insecure" not in argv
    secret, key = _mounted_file(pod, master, argv[argv.index("--auth-file") + 1])
    assert main(["auth", "init", "--out", str(tmp_path)]) == 0
    made = json.loads((tmp_path / auth_cmd.MANIFEST).read_text())["items"]
    by_kind = {d["kind"]: d for d in made}
    for doc in made:
        assert k8s_schema.check_builtin(doc) == []
    assert by_kind["Secret"]["metadata"]["name"] == secret
    keys = by_kind["Secret"]["stringData"][key]
    assert (
        Authority.load(tmp_path / "auth.json").server_config()
        == (by_kind["ConfigMap"]["data"][auth_cmd.NATS_FRAGMENT])
    )
    assert keys == (tmp_path / "auth.json").read_text()
    for name in ("auth.json", auth_cmd.MANIFEST):  # the keys: owner-only
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert main(["auth", "init", "--out", str(tmp_path)]) == 2  # made once: never replaced
    assert (tmp_path / "auth.json").read_text() == keys


def _loopback_config(rendered: str) -> str:
    """The rendered nats.conf less what only works in the cluster (ports, store, routes): what
    is left (the operator-mode include, any auth) goes on a loopback server as it is."""
    text = re.sub(r"(?ms)^cluster \{.*?^\}\n", "", rendered)
    dropped = ("port:", "http:", "server_name:", "jetstream ")
    return "".join(line for line in text.splitlines(keepends=True)
                   if not line.startswith(dropped))  # fmt: skip


async def test_the_deployed_nats_refuses_anonymous_clients(tmp_path: Path) -> None:
    """The rendered NATS configuration is operator mode (its ConfigMap includes what ``aegis
    auth init`` made): a real nats-server with its auth blocks lets the master in, and no
    anonymous client (nor one the account did not sign) reads the KV or sends a control
    request."""
    from aegis.cli import auth_cmd
    from aegis.cli.main import main

    docs = _deployed()
    conf = docs[("ConfigMap", "aegis-nats")]["data"]["nats.conf"]
    nats_pod = docs[("StatefulSet", "aegis-nats")]["spec"]["template"]["spec"]
    volume = next(v for v in nats_pod["volumes"] if v["name"] == "config")
    sources = [s["configMap"]["name"] for s in volume["projected"]["sources"]]
    assert sources == ["aegis-nats", auth_cmd.CONFIGMAP_NAME]
    assert f"include {auth_cmd.NATS_FRAGMENT}" in conf.splitlines()
    assert "no_auth_user" not in conf and "authorization" not in conf
    assert main(["auth", "init", "--out", str(tmp_path / "auth")]) == 0
    authority = Authority.load(tmp_path / "auth" / "auth.json")
    store_dir = tmp_path / "nats"
    store_dir.mkdir()
    shutil.copy(tmp_path / "auth" / auth_cmd.NATS_FRAGMENT, store_dir / auth_cmd.NATS_FRAGMENT)
    server = EmbeddedNats(None, store_dir=store_dir, extra_config=_loopback_config(conf))
    await asyncio.to_thread(server.start)
    try:
        master = await NatsBus.connect(server.url, authority.master_creds())
        store = await KvStore.open(master, STATUS_BUCKET)
        await store.put("default.jobA", b'{"token": "secret"}', expected_revision=None)
        await master.close()
        for creds in (None, Authority().master_creds()):  # anonymous; signed by another account
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await NatsBus.connect(server.url, creds, max_reconnect_attempts=0,
                                      connect_timeout_s=5)  # fmt: skip
    finally:
        server.stop()


# -- the admission webhook (issue 19) ------------------------------------------------------------


def test_the_webhook_is_deployed_with_its_certificate_step_and_an_opt_in_selector() -> None:
    docs = _deployed()
    config = docs[("MutatingWebhookConfiguration", "aegis-webhook")]
    assert k8s_schema.check_builtin(config) == []
    [hook] = config["webhooks"]
    assert hook["objectSelector"] == {"matchLabels": {"aegis.dev/inject": "true"}}
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "NoneOnDryRun"
    [rule] = hook["rules"]
    assert (rule["resources"], rule["operations"]) == (["pods"], ["CREATE"])
    service = hook["clientConfig"]["service"]
    assert "caBundle" not in hook["clientConfig"]  # --make-cert sets it; kubectl apply keeps it
    svc = docs[("Service", service["name"])]
    assert svc["metadata"]["namespace"] == service["namespace"]
    assert svc["spec"]["ports"][0]["port"] == service["port"]
    pod = docs[("Deployment", "aegis-webhook")]["spec"]["template"]["spec"]
    [init], [main] = pod["initContainers"], pod["containers"]
    assert init["command"][:3] == ["aegis", "webhook", "--make-cert"]
    assert main["command"][:2] == ["aegis", "webhook"]
    init_args, main_args = init["command"], main["command"]
    cert_dir = init_args[init_args.index("--cert-dir") + 1]
    assert main_args[main_args.index("--cert-dir") + 1] == cert_dir
    assert init_args[init_args.index("--webhook-config") + 1] == config["metadata"]["name"]
    assert init_args[init_args.index("--service") + 1] == service["name"]
    assert svc["spec"]["ports"][0]["targetPort"] == main["ports"][0]["name"]
    rules = docs[("ClusterRole", "aegis-webhook")]["rules"]
    allowed = {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}
    assert allowed == {("secrets", "get"), ("secrets", "create"), ("pytorchjobs", "get"),
                       ("jobsets", "get"),
                       ("mutatingwebhookconfigurations", "get"),
                       ("mutatingwebhookconfigurations", "patch")}  # fmt: skip
    [subject] = docs[("ClusterRoleBinding", "aegis-webhook")]["subjects"]
    assert subject["name"] == pod["serviceAccountName"]


def test_the_example_pytorchjob_opts_every_replica_in_and_its_pods_wrap() -> None:
    from aegis.platforms.kubernetes import webhook_patch
    from tests.webhook_pods import apply_patch, pytorchjob_pod

    doc = yaml.safe_load((DEPLOY / "examples" / "pytorchjob.yaml").read_text())
    assert doc["kind"] == "PyTorchJob"
    doc["metadata"]["uid"] = "uid-ptj"  # as the API server would give it
    ranks = []
    for kind, spec in doc["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        assert template["metadata"]["labels"][webhook_patch.INJECT] == "true"
        assert k8s_schema.check_model(template, "V1PodTemplateSpec") == []
        for index in range(spec["replicas"]):
            pod = pytorchjob_pod(kind.lower(), index)  # the controller's labels and env ...
            pod["spec"]["containers"] = copy.deepcopy(template["spec"]["containers"])  # the user's
            result = webhook_patch.mutate(pod, "ml", webhook_patch.WebhookSettings(), job=doc)
            assert result.allowed and result.patch and result.identity, result.message
            assert k8s_schema.check_builtin(apply_patch(pod, result.patch)) == []
            ranks.append(result.identity.rank)
    assert sorted(ranks) == [0, 1, 2, 3]  # the master's pods train-0 .. train-3
