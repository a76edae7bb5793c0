"""The webhook's pure decision: which pods are wrapped, how, and as whom (webhook_identity,
webhook_patch, webhook_review)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from aegis.platforms.kubernetes import manifests, webhook_identity, webhook_patch, webhook_review
from tests import k8s_schema
from tests.webhook_pods import apply_patch, jobset_pod, pytorchjob, pytorchjob_pod, review

SETTINGS = webhook_patch.WebhookSettings(master="aegis-master.aegis-system.svc:50051",
                                         agent_image="aegis:test")  # fmt: skip
Body = dict[str, Any]


JOB = pytorchjob()


def _mutate(pod: Body, settings: webhook_patch.WebhookSettings = SETTINGS,
            job: Body | None = JOB) -> webhook_patch.MutationResult:  # fmt: skip
    return webhook_patch.mutate(pod, "ml", settings, job=job)


def _wrapped(pod: Body, settings: webhook_patch.WebhookSettings = SETTINGS,
             job: Body | None = JOB) -> Body:  # fmt: skip
    result = _mutate(pod, settings, job)
    assert result.allowed, result.message
    assert result.patch
    return apply_patch(pod, result.patch)


def _main(pod: Body) -> Body:
    main: Body = pod["spec"]["containers"][0]
    return main


def _agent_flags(command: list[str]) -> dict[str, str]:
    agent = command[2 : command.index("--")]
    return dict(zip(agent[::2], agent[1::2], strict=True))


@pytest.mark.parametrize(
    ("kind", "index", "with_master", "rank"),
    [("master", 0, True, 0), ("worker", 0, True, 1), ("worker", 4, True, 5),
     ("worker", 0, False, 0), ("worker", 2, False, 2)],
)  # fmt: skip
def test_a_pytorchjob_pod_is_wrapped_with_its_rank_and_its_own_secret(
    kind: str, index: int, with_master: bool, rank: int
) -> None:
    pod = pytorchjob_pod(kind, index, with_master=with_master)
    job = pytorchjob(with_master=with_master)
    before_env = copy.deepcopy(_main(pod)["env"])
    out = _wrapped(pod, job=job)
    assert k8s_schema.check_builtin(out) == []
    main = _main(out)
    name = f"train-{rank}"  # the master's name for the rank, not the controller's
    # the original command and args, after the agent's "--"
    assert main["command"][:2] == ["/aegis/bin/aegis", "agent"]
    assert main["command"][main["command"].index("--") + 1 :] == [
        "python", "-u", "train.py", "--epochs", "3"]  # fmt: skip
    assert "args" not in main
    assert _agent_flags(main["command"]) == {
        "--master": SETTINGS.master, "--namespace": "ml", "--job": "train", "--pod": name,
        "--token-file": f"{manifests.TOKEN_DIR}/token"}  # fmt: skip
    # the controller's environment intact, in order, then Aegis's own
    assert main["env"][: len(before_env)] == before_env
    env = {e["name"]: e for e in main["env"]}
    assert env["AEGIS_POD"]["value"] == name and env["AEGIS_JOB"]["value"] == "train"
    assert env["AEGIS_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    labels = out["metadata"]["labels"]
    assert labels[webhook_patch.LABEL_RANK] == str(rank)
    assert labels[webhook_patch.LABEL_JOB] == "train"
    volumes = {v["name"]: v for v in out["spec"]["volumes"]}
    assert volumes[manifests.TOKEN_VOLUME]["secret"]["secretName"] == f"{name}-aegis-pod-token"
    assert volumes[manifests.AGENT_VOLUME] == {"name": manifests.AGENT_VOLUME, "emptyDir": {}}
    [init] = out["spec"]["initContainers"]
    assert init["image"] == "aegis:test" and init["command"][0] == "cp"
    assert {m["mountPath"] for m in main["volumeMounts"]} == {"/aegis", manifests.TOKEN_DIR}
    assert out["spec"]["restartPolicy"] == "OnFailure"  # the controller's: left as it is
    result = _mutate(pod, job=job)
    assert result.identity == webhook_identity.Identity(
        "ml", "train", name, rank,
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "train", "uid": "uid-ptj"},
        f"train-{kind}-{index}",
    )  # fmt: skip


def test_a_pytorchjob_pod_needs_its_own_job_object_for_its_rank() -> None:
    pod = pytorchjob_pod("worker", 0)
    assert "its PyTorchJob was not found" in _mutate(pod, job=None).message
    impostor = pytorchjob()
    impostor["metadata"]["uid"] = "uid-other"  # same name, another object: not its controller
    assert "another uid" in _mutate(pod, job=impostor).message
    second_master = pytorchjob_pod("master", 1)
    assert "no such master" in _mutate(second_master).message
    master = pytorchjob_pod("master", 0)
    assert "no such master" in _mutate(master, job=pytorchjob(with_master=False)).message
    assert "another uid" in _mutate(master, job=impostor).message  # the master's checked too


@pytest.mark.parametrize("node", [0, 1, 7])
def test_a_trainjob_jobset_pod_is_named_by_its_indexes_not_its_generated_name(node: int) -> None:
    pod = jobset_pod(node)
    out = _wrapped(pod, job=None)
    assert k8s_schema.check_builtin(out) == []
    main = _main(out)
    assert main["command"][main["command"].index("--") + 1 :] == ["torchrun", "train.py"]
    name = f"llm-{node}"  # by its completion index: its generated name is unknown at admission
    assert _agent_flags(main["command"])["--pod"] == name
    assert out["metadata"]["labels"][webhook_patch.LABEL_RANK] == str(node)
    env = {e["name"]: e for e in main["env"]}
    assert env["PET_NODE_RANK"] == pod["spec"]["containers"][0]["env"][-1]  # downward API kept
    assert env["PET_NNODES"]["value"] == "2"
    identity = _mutate(pod, job=None).identity
    assert identity is not None and identity.owner["kind"] == "JobSet"
    assert (identity.owner["uid"], identity.source) == ("uid-js", f"llm-node-0-{node}")


def test_a_jobsets_other_replicated_jobs_are_left_and_several_jobs_refused() -> None:
    init = jobset_pod(0)
    init["metadata"]["labels"][webhook_identity.JS_RJOB] = "dataset-initializer"
    left = _mutate(init, job=None)
    assert (left.allowed, left.patch, left.identity) == (True, [], None)
    assert "not the training" in left.warnings[0]
    pod = jobset_pod(1)
    pod["metadata"]["labels"][webhook_identity.JS_INDEX] = "2"
    pod["metadata"]["ownerReferences"][0]["name"] = "llm-node-2"
    refused = _mutate(pod, job=None)
    assert not refused.allowed and "one Indexed Job" in refused.message


def test_a_pod_without_the_opt_in_is_untouched() -> None:
    for pod in (pytorchjob_pod("worker", 0), jobset_pod(0)):
        del pod["metadata"]["labels"][webhook_patch.INJECT]
        assert _mutate(pod) == webhook_patch.MutationResult(True)
        pod["metadata"]["labels"][webhook_patch.INJECT] = "false"
        assert _mutate(pod).patch == []
    pod = pytorchjob_pod("worker", 0)
    del pod["metadata"]["labels"][webhook_patch.INJECT]
    pod["metadata"]["annotations"] = {webhook_patch.INJECT: "true"}  # the annotation opts in too
    assert _mutate(pod).patch


def test_a_wrapped_pod_is_not_wrapped_twice() -> None:
    once = _wrapped(pytorchjob_pod("worker", 1))
    again = _mutate(once)
    assert again == webhook_patch.MutationResult(True)  # reinvocation: nothing to change
    # ... but "wrapped" is judged, not claimed: the marker on a pod with another pod's token
    # volume is refused, never accepted as it is.
    forged = copy.deepcopy(once)
    token = next(v for v in forged["spec"]["volumes"] if v["name"] == manifests.TOKEN_VOLUME)
    token["secret"]["secretName"] = "train-0-aegis-pod-token"
    refused = _mutate(forged)
    assert not refused.allowed and manifests.TOKEN_VOLUME in refused.message


def test_hostile_fields_do_not_change_who_the_pod_is() -> None:
    """A pod's author cannot claim another pod's identity: AEGIS_* and MASTER_ADDR env,
    aegis.dev annotations and the pod's own name are ignored; the controller's labels, owner
    and job object decide."""
    pod = pytorchjob_pod("worker", 1)
    pod["metadata"]["name"] = "train-0"
    pod["metadata"]["annotations"] = {webhook_patch.INJECTED: "train-0", "aegis.dev/pod": "train-0",
                                      webhook_identity.JS_INDEX: "0"}  # fmt: skip
    _main(pod)["env"] += [{"name": "AEGIS_POD", "value": "train-0"},
                          {"name": "AEGIS_JOB", "value": "other"},
                          {"name": "MASTER_ADDR", "value": "train-worker-0"}]  # fmt: skip
    out = _wrapped(pod)
    main = _main(out)
    assert _agent_flags(main["command"])["--pod"] == "train-2"
    aegis_env = [(e["name"], e.get("value")) for e in main["env"] if e["name"] in
                 ("AEGIS_POD", "AEGIS_JOB")]  # fmt: skip
    assert aegis_env == [("AEGIS_JOB", "train"), ("AEGIS_POD", "train-2")]
    assert out["metadata"]["annotations"][webhook_patch.INJECTED] == "train-2"
    # labels naming a job that does not control the pod: refused
    other = pytorchjob_pod("master", 0)
    other["metadata"]["labels"][webhook_identity.KF_JOB] = "victim"
    refused = _mutate(other)
    assert not refused.allowed and "not controlled by the PyTorchJob 'victim'" in refused.message
    # a token volume of the pod's own choosing: refused
    chooser = pytorchjob_pod("worker", 0)
    stolen = {"secretName": "train-0-aegis-pod-token"}
    chooser["spec"]["volumes"] = [{"name": manifests.TOKEN_VOLUME, "secret": stolen}]
    refused = _mutate(chooser)
    assert not refused.allowed and "cannot choose its own Aegis volumes" in refused.message


def test_a_container_with_args_only_needs_the_entrypoint_annotation() -> None:
    pod = pytorchjob_pod("worker", 0)
    del _main(pod)["command"]
    refused = _mutate(pod)
    assert not refused.allowed
    assert "ENTRYPOINT" in refused.message and webhook_patch.ENTRYPOINT in refused.message
    pod["metadata"]["annotations"] = {webhook_patch.ENTRYPOINT: "python -u"}  # not JSON
    assert "JSON list" in _mutate(pod).message
    pod["metadata"]["annotations"] = {webhook_patch.ENTRYPOINT: '["python", "-u"]'}
    main = _main(_wrapped(pod))
    assert main["command"][main["command"].index("--") + 1 :] == [
        "python", "-u", "train.py", "--epochs", "3"]  # fmt: skip


def test_the_training_container_is_found_by_name_and_tls_settings_reach_the_agent() -> None:
    pod = pytorchjob_pod("master", 0)
    pod["spec"]["containers"].insert(0, {"name": "sidecar", "image": "busybox",
                                         "command": ["sleep", "inf"]})  # fmt: skip
    settings = webhook_patch.WebhookSettings(tls_ca_configmap="aegis-ca", hang_timeout_s=120.0)
    out = _wrapped(pod, settings)
    assert out["spec"]["containers"][0]["command"] == ["sleep", "inf"]
    command = out["spec"]["containers"][1]["command"]
    flags = _agent_flags(command)
    assert flags["--tls-ca"] == f"{manifests.CA_DIR}/ca.crt"
    assert flags["--hang-timeout-s"] == "120.0"
    assert {"name": manifests.CA_VOLUME, "configMap": {"name": "aegis-ca"}} in out["spec"][
        "volumes"
    ]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [(lambda p: p["metadata"]["labels"].pop(webhook_identity.KF_INDEX), "replica-index"),
     (lambda p: p["metadata"]["labels"].update({webhook_identity.KF_INDEX: "-1"}), "integer"),
     (lambda p: p["metadata"]["labels"].update({webhook_identity.KF_TYPE: "ps"}), "master or"),
     (lambda p: p["metadata"].pop("ownerReferences"), "not controlled"),
     (lambda p: p["metadata"]["labels"].pop(webhook_identity.KF_TYPE), "no job controller"),
     (lambda p: p["spec"].update({"containers": []}), "no containers")],
)  # fmt: skip
def test_a_pod_that_cannot_be_named_is_refused_with_the_reason(edit: Any, needle: str) -> None:
    pod = pytorchjob_pod("worker", 0)
    edit(pod)
    refused = _mutate(pod)
    assert not refused.allowed and refused.patch == []
    assert needle in refused.message and refused.message.startswith("aegis: cannot wrap")


def test_the_review_answer_carries_the_patch_or_the_refusal() -> None:
    pod = pytorchjob_pod("worker", 0)
    req = webhook_review.request(review(pod, uid="u-1"))
    result = webhook_patch.mutate(req.pod, req.namespace, SETTINGS, job=JOB)
    answer = webhook_review.response(req.uid, result)["response"]
    assert answer["uid"] == "u-1" and answer["allowed"] is True
    assert answer["patchType"] == "JSONPatch"
    assert json.loads(base64.b64decode(answer["patch"])) == result.patch
    refused = webhook_patch.MutationResult(allowed=False, message="aegis: no")
    status = {"code": 403, "message": "aegis: no"}
    assert webhook_review.response("u-2", refused)["response"] == {
        "uid": "u-2", "allowed": False, "status": status}  # fmt: skip
    untouched = webhook_review.response("u-3", webhook_patch.MutationResult(True))["response"]
    assert untouched == {"uid": "u-3", "allowed": True}


@pytest.mark.parametrize(
    ("body", "needle"),
    [([], "not a JSON object"), ({"apiVersion": "v1", "kind": "Pod"}, "expected apiVersion"),
     ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}, "no request"),
     ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}, "no uid")],
)  # fmt: skip
def test_a_malformed_review_is_refused_with_a_clear_message(body: Any, needle: str) -> None:
    with pytest.raises(webhook_review.ReviewError, match=needle):
        webhook_review.request(body)


def test_a_review_of_something_else_than_a_pod_creation_is_refused() -> None:
    doc = review(pytorchjob_pod("worker", 0))
    doc["request"]["operation"] = "UPDATE"
    with pytest.raises(webhook_review.ReviewError, match="not CREATE"):
        webhook_review.request(doc)
    doc = review(pytorchjob_pod("worker", 0))
    doc["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    with pytest.raises(webhook_review.ReviewError, match="not a core/v1 Pod"):
        webhook_review.request(doc)
    doc = review(pytorchjob_pod("worker", 0))
    del doc["request"]["object"]
    with pytest.raises(webhook_review.ReviewError, match="no object"):
        webhook_review.request(doc)
