"""The admission webhook over real TLS (a CA the test makes with ``cryptography``), its Secrets
provisioned in kmock's Kubernetes emulator through the real ``kubernetes`` client: kmock has
no admission chain, so the tests POST AdmissionReviews as the API server would."""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest

from aegis.platforms.kubernetes import (
    cluster,
    crd_status,
    manifests,
    webhook_certs,
    webhook_cluster,
    webhook_patch,
    webhook_server,
    wrapped_jobs,
)
from aegis.wire.tokens import pod_token
from tests import k8s_emulator, k8s_schema
from tests.webhook_pods import (
    apply_patch,
    declare_pytorchjobs,
    jobset_pod,
    pytorchjob,
    pytorchjob_pod,
    review,
)

pytestmark = pytest.mark.timeout(60)
SETTINGS = webhook_patch.WebhookSettings(agent_image="aegis:test")
Body = dict[str, Any]


@dataclass
class Webhook:
    emulator: kmock.KubernetesEmulator
    url: str
    ca_file: Path

    async def post(self, body: Any, *, ca: Path | None = None) -> tuple[int, Any]:
        context = ssl.create_default_context(cafile=str(ca or self.ca_file))
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{self.url}/mutate", json=body, ssl=context) as resp,
        ):
            text = await resp.text()
            is_json = resp.content_type == "application/json"
            return resp.status, json.loads(text) if is_json else text

    def secret(self, name: str) -> Body | None:
        for (resource, namespace, found), obj in self.emulator.objects.items():
            if resource.plural == "secrets" and (namespace, found, obj.deleted) == (
                "ml", name, False):  # fmt: skip
                raw: Body = obj.raw
                return raw
        return None

    def secrets(self) -> set[str]:
        return {name for (resource, _, name), obj in self.emulator.objects.items()
                if resource.plural == "secrets" and not obj.deleted}  # fmt: skip


def write_cert(root: Path, names: list[str]) -> webhook_certs.ServingCert:
    cert = webhook_certs.make(names)
    root.mkdir(parents=True, exist_ok=True)
    (root / "ca.crt").write_bytes(cert.ca_pem)
    (root / "tls.crt").write_bytes(cert.cert_pem)
    (root / "tls.key").write_bytes(cert.key_pem)
    return cert


@pytest.fixture
async def webhook(
    kmock: kmock.KubernetesEmulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Webhook]:
    k8s_emulator.use_kubeconfig(kmock, tmp_path, monkeypatch)
    k8s_emulator.declare(kmock)
    declare_pytorchjobs(kmock, pytorchjob("train"), pytorchjob("solo", with_master=False))
    certs = tmp_path / "certs"
    write_cert(certs, ["127.0.0.1"])
    api = webhook_cluster.WebhookCluster(cluster.load_config())
    runner, port = await webhook_server.start(
        SETTINGS, api, cert_file=certs / "tls.crt", key_file=certs / "tls.key",
        host="127.0.0.1", port=0,
    )  # fmt: skip
    try:
        yield Webhook(kmock, f"https://127.0.0.1:{port}", certs / "ca.crt")
    finally:
        await runner.cleanup()


def _token(secret: Body | None) -> str:
    found = crd_status.token(secret)
    assert found is not None
    return found


def _admitted(pod: Body, answer: Body, uid: str) -> Body:
    response = answer["response"]
    assert (response["uid"], response["allowed"]) == (uid, True), response
    assert response["patchType"] == "JSONPatch"
    wrapped = apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    assert k8s_schema.check_builtin(wrapped) == []
    return wrapped


async def test_pytorchjob_pods_come_out_wrapped_each_with_its_own_secret(webhook: Webhook) -> None:
    job_tokens = set()
    for kind, index, rank in (("master", 0, 0), ("worker", 0, 1), ("worker", 1, 2)):
        pod = pytorchjob_pod(kind, index)
        status, answer = await webhook.post(review(pod, uid=f"uid-{kind}-{index}"))
        assert status == 200
        wrapped = _admitted(pod, answer, f"uid-{kind}-{index}")
        name = f"train-{rank}"  # train-master-0 is rank 0, train-worker-i rank i + 1
        assert wrapped["metadata"]["labels"][webhook_patch.LABEL_RANK] == str(rank)
        volumes = {v["name"]: v for v in wrapped["spec"]["volumes"]}
        secret_name = volumes[manifests.TOKEN_VOLUME]["secret"]["secretName"]
        assert secret_name == f"{name}-aegis-pod-token"
        job_token = _token(webhook.secret("train-aegis-job-token"))
        job_tokens.add(job_token)
        # the pod's own secret, derived as the master checks it; never the job's
        assert _token(webhook.secret(secret_name)) == pod_token(job_token, "ml", "train", name)
        assert _token(webhook.secret(secret_name)) != job_token
        owner = webhook.secret(secret_name)["metadata"]["ownerReferences"][0]  # type: ignore[index]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("PyTorchJob", "train", "uid-ptj")
    assert len(job_tokens) == 1  # one job secret, made once
    pods = ("train-0", "train-1", "train-2")
    assert webhook.secrets() == {"train-aegis-job-token", *(f"{p}-aegis-pod-token" for p in pods)}


async def test_a_pytorchjob_without_master_has_its_workers_from_rank_0(webhook: Webhook) -> None:
    pod = pytorchjob_pod("worker", 0, job="solo", with_master=False)
    pod["metadata"]["ownerReferences"][0]["name"] = "solo"
    _, answer = await webhook.post(review(pod, uid="solo-0"))
    wrapped = _admitted(pod, answer, "solo-0")
    assert "solo-0-aegis-pod-token" in {v.get("secret", {}).get("secretName")
                                    for v in wrapped["spec"]["volumes"]}  # fmt: skip
    orphan = pytorchjob_pod("worker", 0, job="gone")  # its PyTorchJob is not there
    orphan["metadata"]["ownerReferences"][0]["name"] = "gone"
    _, answer = await webhook.post(review(orphan, uid="gone-0"))
    assert answer["response"]["allowed"] is False
    assert "its PyTorchJob was not found" in answer["response"]["status"]["message"]
    assert "gone-aegis-job-token" not in webhook.secrets()


async def test_a_trainjob_pod_comes_out_wrapped_and_a_replacement_keeps_its_secret(
    webhook: Webhook,
) -> None:
    pod = jobset_pod(1)
    _, answer = await webhook.post(review(pod, uid="u1"))
    wrapped = _admitted(pod, answer, "u1")
    main = wrapped["spec"]["containers"][0]
    assert main["command"][main["command"].index("--") + 1 :] == ["torchrun", "train.py"]
    first = _token(webhook.secret("llm-1-aegis-pod-token"))
    _, again = await webhook.post(review(jobset_pod(1), uid="u2"))  # the pod's replacement
    assert _admitted(pod, again, "u2") == wrapped
    assert _token(webhook.secret("llm-1-aegis-pod-token")) == first
    assert first == pod_token(_token(webhook.secret("llm-aegis-job-token")), "ml", "llm", "llm-1")


async def test_a_pod_made_once_its_job_has_started_rejoins_it(
    kmock: kmock.KubernetesEmulator, webhook: Webhook
) -> None:
    """A PyTorchJob's pod recreated once the master took the job past Pending (its status
    annotation says so) is placed again in a running job: its agent gets ``--rejoin`` and never
    runs the command on its own when it cannot reach the master. The job's first pods may."""
    _, answer = await webhook.post(review(pytorchjob_pod("worker", 0), uid="first"))
    first = _admitted(pytorchjob_pod("worker", 0), answer, "first")["spec"]["containers"][0]
    assert "--rejoin" not in first["command"]
    running = pytorchjob("train")
    running["metadata"]["annotations"] = {wrapped_jobs.STATUS: json.dumps({"phase": "RunCommand"})}
    declare_pytorchjobs(kmock, running)
    _, answer = await webhook.post(review(pytorchjob_pod("worker", 0), uid="again"))
    again = _admitted(pytorchjob_pod("worker", 0), answer, "again")["spec"]["containers"][0]
    assert again["command"][again["command"].index("--rejoin") + 1] == "--"
    assert (
        again["command"][again["command"].index("--") + 1 :]
        == first["command"][first["command"].index("--") + 1 :]
    )


async def test_a_pod_without_the_label_is_untouched_and_gets_no_secret(webhook: Webhook) -> None:
    pod = pytorchjob_pod("worker", 0)
    del pod["metadata"]["labels"][webhook_patch.INJECT]
    status, answer = await webhook.post(review(pod, uid="plain"))
    assert (status, answer["response"]) == (200, {"uid": "plain", "allowed": True})
    assert webhook.secrets() == set()


async def test_a_dry_run_gets_the_same_answer_and_makes_no_secret(webhook: Webhook) -> None:
    pod = pytorchjob_pod("worker", 0)
    dry = review(pod, uid="dry")
    dry["request"]["dryRun"] = True
    _, answer = await webhook.post(dry)
    assert _admitted(pod, answer, "dry")["spec"]["initContainers"]
    assert webhook.secrets() == set()
    _, answer = await webhook.post(review(pod, uid="real"))
    assert _admitted(pod, answer, "real")
    assert "train-1-aegis-pod-token" in webhook.secrets()


async def test_an_unwrappable_pod_is_refused_with_the_reason(webhook: Webhook) -> None:
    pod = pytorchjob_pod("worker", 0)
    del pod["spec"]["containers"][0]["command"]
    status, answer = await webhook.post(review(pod, uid="args-only"))
    assert status == 200
    response = answer["response"]
    assert response["allowed"] is False and response["status"]["code"] == 403
    assert webhook_patch.ENTRYPOINT in response["status"]["message"]
    assert webhook.secrets() == set()


async def test_a_malformed_review_gets_a_400_naming_the_problem(webhook: Webhook) -> None:
    status, text = await webhook.post({"apiVersion": "admission.k8s.io/v1beta1",
                                       "kind": "AdmissionReview"})  # fmt: skip
    assert status == 400 and "expected apiVersion admission.k8s.io/v1" in text
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{webhook.url}/mutate", data=b"{not json", ssl=context) as resp:
            assert resp.status == 400 and "not JSON" in await resp.text()
        async with session.get(f"{webhook.url}/healthz", ssl=context) as resp:
            assert (resp.status, await resp.text()) == (200, "ok\n")


async def test_a_client_that_does_not_trust_the_ca_cannot_talk_to_it(
    webhook: Webhook, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    write_cert(other, ["127.0.0.1"])
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await webhook.post(review(pytorchjob_pod("worker", 0)), ca=other / "ca.crt")
    assert webhook.secrets() == set()


class _BrokenSecrets:
    async def get_pytorchjob(self, namespace: str, name: str) -> Body | None:
        return pytorchjob(name)

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        raise RuntimeError("forbidden: secrets is forbidden")

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        return None


async def test_a_pod_whose_secret_cannot_be_made_is_refused_not_started_without_it() -> None:
    answer = await webhook_server.answer(review(pytorchjob_pod("worker", 0), uid="u"), SETTINGS,
                                         _BrokenSecrets())  # fmt: skip
    response = answer["response"]
    assert response["allowed"] is False and "patch" not in response
    assert "train-1" in response["status"]["message"]
    assert "forbidden" in response["status"]["message"]


class _SecretsOfAnAegisJob(_BrokenSecrets):
    """The namespace holds AegisJob ``train``'s Secret when PyTorchJob ``train``'s pods come."""

    def __init__(self) -> None:
        owner = {"apiVersion": "aegis.dev/v1", "kind": "AegisJob", "name": "train", "uid": "a-1"}
        self.stored: dict[str, Body] = {
            "train-aegis-job-token": {
                "metadata": {"name": "train-aegis-job-token", "ownerReferences": [owner]},
                "data": {"token": base64.b64encode(b"the-aegisjobs").decode()},
            }
        }

    async def ensure_secret(self, namespace: str, body: Body) -> None:
        self.stored.setdefault(body["metadata"]["name"], body)

    async def get_secret(self, namespace: str, name: str) -> Body | None:
        return self.stored.get(name)


async def test_a_pod_whose_jobs_secret_belongs_to_another_object_is_refused() -> None:
    """An AegisJob and a PyTorchJob of one name: the 409 on the job's Secret kept the
    AegisJob's, and the PyTorchJob's pod got a token derived from it (it could speak for the
    AegisJob's pod of its rank). It is refused now, and no pod Secret is made."""
    api = _SecretsOfAnAegisJob()
    answer = await webhook_server.answer(review(pytorchjob_pod("worker", 0), uid="u"), SETTINGS,
                                         api)  # fmt: skip
    response = answer["response"]
    assert response["allowed"] is False and "patch" not in response
    assert "train-aegis-job-token is owned by ['a-1']" in response["status"]["message"]
    assert set(api.stored) == {"train-aegis-job-token"}


@pytest.mark.timeout(300)  # two fresh interpreters importing the whole CLI
def test_the_webhook_without_the_kubernetes_extra_names_the_pip_command() -> None:
    for missing in ("kubernetes", "cryptography"):
        code = (f"import sys; sys.modules[{missing!r}] = None\n"
                "from aegis.cli.main import main\nsys.exit(main(['webhook']))")  # fmt: skip
        env = {**os.environ, "KUBECONFIG": "/nonexistent"}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=env, check=False)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            f"aegis: error: the webhook needs {missing} (not installed): "
            "pip install 'aegis-ft[kubernetes]'"
        ]
