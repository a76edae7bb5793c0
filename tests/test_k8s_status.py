"""The master's side of an AegisJob as pure data: spec and token in, ``.status`` out."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from aegis.core import events as ev
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus, NodeName, PodName, initial_status
from aegis.platforms.kubernetes import crd_status
from aegis.wire import status_json
from tests.test_k8s_handlers import job_body

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
SPEC = JobSpec("train", "ml", 3, 2)


def record_of(status: JobStatus, spec: JobSpec = SPEC, **extra: Any) -> dict[str, Any]:
    record = status_json.to_dict(spec, status)
    record.update(orders=[], epoch=1, token="t", nodes=["a", "b", "c"], **extra)
    return record


def started() -> JobStatus:
    return initial_status(SPEC, [NodeName(n) for n in ("a", "b", "c")])


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_job_spec_comes_from_the_aegisjob_spec() -> None:
    assert crd_status.job_spec(job_body(replicas=4)) == JobSpec("train", "ml", 4, 2)


def test_job_spec_is_refused_when_replicas_is_zero() -> None:
    with pytest.raises(ValueError, match="worker_num"):
        crd_status.job_spec(job_body(replicas=0))


def test_token_is_decoded_from_the_secret_data() -> None:
    secret = {"data": {"token": base64.b64encode(b"s3cret").decode()}}
    assert crd_status.token(secret) == "s3cret"
    assert crd_status.token({"stringData": {"token": "plain"}}) == "plain"


@pytest.mark.parametrize("secret", [None, {}, {"data": {}}, {"data": {"token": "%%%"}}])
def test_token_is_none_when_the_secret_has_none(secret: dict[str, Any] | None) -> None:
    assert crd_status.token(secret) is None


def _pod(name: str, node: str | None, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **meta}, "spec": {"nodeName": node} if node else {}}


def test_scheduled_nodes_are_in_rank_order_when_every_pod_is_scheduled() -> None:
    pods = [_pod("train-2", "n2"), _pod("train-0", "n0"), _pod("train-1", "n1")]
    assert crd_status.scheduled_nodes(SPEC, pods) == ["n0", "n1", "n2"]


@pytest.mark.parametrize(
    "pods",
    [
        [_pod("train-0", "n0"), _pod("train-1", "n1")],  # train-2 not created yet
        [_pod("train-0", "n0"), _pod("train-1", "n1"), _pod("train-2", None)],  # unscheduled
        [_pod("train-0", "n0"), _pod("train-1", "n1"),
         _pod("train-2", "n2", deletionTimestamp=T0)],  # going away
    ],
)  # fmt: skip
def test_scheduled_nodes_is_none_while_a_pod_is_not_placed(pods: list[dict[str, Any]]) -> None:
    assert crd_status.scheduled_nodes(SPEC, pods) is None


def test_status_of_a_new_job_is_pending_with_every_condition_false() -> None:
    status = crd_status.cr_status(record_of(started()), now=T0)
    assert status["phase"] == "Pending"
    assert status["message"] == (
        "max restarts 2, restarted 0 times; hardware problems rescheduled 0 times"
    )
    assert status["pod_infos"]["train-1"] == {
        "pod_ip": "", "node": "b", "inner_phase": "Pending", "finished": False, "retries": 0,
        "last_failed_reason": "", "updated_ts": 0.0,
    }  # fmt: skip
    assert conditions(status) == {"Running": ("False", "Pending"),
                                  "Recovering": ("False", "Pending"),
                                  "Succeeded": ("False", "Pending"),
                                  "Failed": ("False", "Pending")}  # fmt: skip
    assert {c["lastTransitionTime"] for c in status["conditions"]} == {T0}


def _run_to_training() -> JobStatus:
    status = started()
    for pod in ("train-0", "train-1", "train-2"):
        status, _ = machine.step(SPEC, status, ev.PodAcked(PodName(pod)), 1.0)
    return status


def test_status_is_running_with_running_true_when_the_job_trains() -> None:
    status = _run_to_training()
    record = record_of(status)
    record["status"]["phase"] = "RunCommand"
    out = crd_status.cr_status(record, now=T0)
    assert conditions(out)["Running"] == ("True", "RunCommand")
    assert conditions(out)["Recovering"] == ("False", "RunCommand")


def test_status_carries_retries_error_nodes_and_the_user_line_when_a_node_was_bad() -> None:
    record = record_of(started(), hardware_rescheduled=1)
    raw = record["status"]
    raw.update(phase="Restarting", recover_count=1)
    pod = raw["pod_infos"]["train-1"]
    pod.update(retries=1, inner_phase="Restarting", last_failed_reason="gpu: ecc errors")
    pod["pod_ip"] = None
    raw["error_nodes"] = [{"node": "b", "reason": "gpu: ecc errors", "ts": 5.0}]
    out = crd_status.cr_status(record, now=T0, replacing={"train-1": "uid-b"})
    assert out["recover_count"] == 1 and out["restarted"] == 1
    assert out["hardware_rescheduled"] == 1
    assert out["message"] == (
        "max restarts 2, restarted 1 times; hardware problems rescheduled 1 times"
    )
    assert out["error_nodes"] == [{"node": "b", "reason": "gpu: ecc errors", "ts": 5.0}]
    assert out["pod_infos"]["train-1"]["retries"] == 1
    assert "pod_ip" not in out["pod_infos"]["train-1"]  # null is not a string in the CRD
    assert out["replacing"] == {"train-1": "uid-b"}
    assert conditions(out)["Recovering"] == ("True", "Restarting")


def test_status_lists_the_drained_nodes_and_a_new_leader_reads_them_back() -> None:
    drained = {"z": crd_status.DrainedNode("maintenance", 7.0, cordoned=True),
               "c": crd_status.DrainedNode("bios update", 9.0)}  # fmt: skip
    out = crd_status.cr_status(record_of(started()), now=T0, drained=drained)
    assert out["drained_nodes"] == [
        {"node": "c", "reason": "bios update", "ts": 9.0, "cordoned": False},
        {"node": "z", "reason": "maintenance", "ts": 7.0, "cordoned": True},
    ]
    assert out["error_nodes"] == []  # drained is not broken
    assert crd_status.drained_nodes(out) == drained
    assert crd_status.cr_status(record_of(started()), now=T0)["drained_nodes"] == []
    garbage = {"drained_nodes": [{"reason": "no node"}, "not a map", {"node": "ok"}]}
    assert crd_status.drained_nodes(garbage) == {"ok": crd_status.DrainedNode("", 0.0)}
    assert crd_status.drained_nodes(None) == {}


@pytest.mark.parametrize(
    ("recover_count", "should_quit", "reason"),
    [(3, False, "BudgetExhausted"), (1, True, "Stopped"), (0, False, "Failed")],
)
def test_failed_condition_says_why_when_the_job_failed(
    recover_count: int, should_quit: bool, reason: str
) -> None:
    record = record_of(started())
    record["status"].update(phase="Failed", recover_count=recover_count, should_quit=should_quit)
    out = crd_status.cr_status(record, now=T0)
    assert conditions(out)["Failed"] == ("True", reason)
    assert conditions(out)["Succeeded"] == ("False", "Failed")


def test_a_job_stopped_by_the_repeat_rule_says_so_and_why() -> None:
    """Restart or stop ended the job with budget left: not ``Stopped`` (nobody stopped it) but
    ``RepeatedFault``, with the master's verdict in the condition and ``.status.ended``."""
    verdict = "the same fault 3 times in a row at step 29 (ValueError: bad): a restart ..."
    record = record_of(started(), ended=verdict)
    run = {"step": 29, "reason": "ValueError: bad", "count": 3}
    record["status"].update(phase="Failed", recover_count=2, should_quit=True, repeat=run)
    out = crd_status.cr_status(record, now=T0)
    assert conditions(out)["Failed"] == ("True", "RepeatedFault")
    failed = next(c for c in out["conditions"] if c["type"] == "Failed")
    # the fault that stopped it was counted, and not restarted
    assert failed["message"].startswith(f"{verdict}; max restarts 2, restarted 1 times")
    assert out["ended"] == verdict
    running = crd_status.cr_status(record_of(started()), now=T0)
    assert running["ended"] == "" and conditions(running)["Failed"] == ("False", "Pending")


def test_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    record = record_of(started())
    record["status"]["phase"] = "RunCommand"
    first = crd_status.cr_status(record, now=T0)
    record["status"]["seq"] = 7
    again = crd_status.cr_status(record, first["conditions"], now=T1)
    assert {c["lastTransitionTime"] for c in again["conditions"]} == {T0}
    record["status"]["phase"] = "Succeed"
    done = crd_status.cr_status(record, again["conditions"], now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in done["conditions"]}
    assert times == {"Running": T1, "Recovering": T0, "Succeeded": T1, "Failed": T0}


def test_same_status_ignores_only_the_transition_times() -> None:
    record = record_of(started())
    first = crd_status.cr_status(record, now=T0)
    assert crd_status.same_status(first, crd_status.cr_status(record, now=T1))
    record["status"]["seq"] = 1
    assert not crd_status.same_status(first, crd_status.cr_status(record, now=T0))


def test_merge_patch_nulls_the_keys_gone_from_the_maps() -> None:
    before = {"phase": "Restarting", "replacing": {"train-1": "u1"}, "error_nodes": [{"node": "b"}],
              "pod_infos": {"train-0": {"node": "a"}, "train-9": {"node": "z"}}}  # fmt: skip
    after = {"phase": "Pending", "replacing": {}, "error_nodes": [],
             "pod_infos": {"train-0": {"node": "a"}}}  # fmt: skip
    assert crd_status.merge_patch(before, after) == {
        "phase": "Pending", "replacing": {"train-1": None}, "error_nodes": [],
        "pod_infos": {"train-9": None, "train-0": {"node": "a"}},
    }  # fmt: skip
    assert crd_status.merge_patch(None, after) == after
