"""The pure decisions of the master's Kubernetes side about replaced pods
(``platforms.kubernetes.replacements``)."""

from __future__ import annotations

from typing import Any

from aegis.platforms.kubernetes import replacements


def _pod(name: str, uid: str, *, node: str = "n-1", created: str = "2024-01-01T00:00:10Z",
         deleting: bool = False) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {"name": name, "uid": uid, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = created
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"podIP": "10.0.0.9"}}


def _record(**infos: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"pod_infos": infos}}


DECIDED = 1704067210.5  # 2024-01-01T00:00:10.5Z


def test_waiting_lists_the_restarting_pods_not_finished() -> None:
    record = _record(
        a={"inner_phase": "Restarting", "finished": False},
        b={"inner_phase": "Restarting", "finished": True},
        c={"inner_phase": "RunCommand", "finished": False},
    )
    assert replacements.waiting(record) == ["a"]


def test_a_replacement_is_live_scheduled_and_not_the_pod_replaced() -> None:
    assert replacements.is_replacement(_pod("a", "new"), "old", DECIDED)
    assert not replacements.is_replacement(_pod("a", "old"), "old", DECIDED)
    assert not replacements.is_replacement(_pod("a", "new", deleting=True), "old", DECIDED)
    assert not replacements.is_replacement(_pod("a", "new", node=""), "old", DECIDED)


def test_with_the_uid_unknown_a_replacement_is_created_no_earlier_than_the_decision() -> None:
    assert replacements.is_replacement(_pod("a", "x"), "", DECIDED)  # same second
    early = _pod("a", "x", created="2024-01-01T00:00:09Z")
    assert not replacements.is_replacement(early, "", DECIDED)
    assert not replacements.is_replacement(_pod("a", "x", created="garbage"), "", DECIDED)


def test_uid_replaced_is_empty_when_the_pod_there_already_is_the_replacement() -> None:
    record = _record(a={"updated_ts": DECIDED})
    early = _pod("a", "old", created="2024-01-01T00:00:09Z")
    assert replacements.uid_replaced(record, [early], "a") == "old"
    later = _pod("a", "new", created="2024-01-01T00:00:11Z")
    assert replacements.uid_replaced(record, [later], "a") == ""
    assert replacements.uid_replaced(record, [], "a") == ""


def test_a_pod_created_in_the_decisions_second_is_the_one_replaced() -> None:
    """The operator replaces a pod only once the side has listed it: the pod there when the
    request arrives, created in the same second (it failed at once), is not its own
    replacement (it was taken for one, and announced back while it lay dead)."""
    record = _record(a={"updated_ts": DECIDED})
    assert replacements.uid_replaced(record, [_pod("a", "crashed")], "a") == "crashed"


def test_back_names_each_replacement_once() -> None:
    record = _record(a={"updated_ts": DECIDED}, b={"updated_ts": DECIDED})
    pods = [_pod("a", "new"), _pod("b", "old")]
    found = replacements.back(record, pods, {"a": "old", "b": "old"}, set())
    assert [(name, replacements.uid(pod)) for name, pod in found] == [("a", "new")]
    assert replacements.back(record, pods, {"a": "old"}, {("a", "new")}) == []
