"""A node the platform finds down (``NodeDown``, core ``rounds.node_down``): it joins the
error nodes and is blacklisted; nothing is counted and nothing else changes. Found on the
emulated cluster: after a node died, its pod went to a spare, but the run's summary said
"error nodes: none" (only the platform knew)."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import NodeName
from aegis.core.phases import Phase
from tests.core_helpers import Driver, rejected


def test_a_node_found_down_joins_error_nodes_and_nothing_is_counted_again() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.HeartbeatLost(d.pod(1)))  # the fault: counted once, the pod replaced
    before = d.status
    actions = d.feed(ev.NodeDown(NodeName("node-1"), "its namespaces' holder exited"))
    assert actions == (act.BlacklistNode(NodeName("node-1"), "its namespaces' holder exited"),)
    s = d.status
    assert [(e.node, e.reason) for e in s.error_nodes] == [
        ("node-1", "its namespaces' holder exited")
    ]
    assert (s.phase, s.seq, s.recover_count, s.away, s.outstanding, s.pod_infos) == (
        before.phase, before.seq, before.recover_count, before.away, before.outstanding,
        before.pod_infos,
    )  # fmt: skip
    d.feed(ev.PodRestarted(d.pod(1), NodeName("node-3")))  # on a spare
    d.feed(ev.PodAcked(d.pod(1)))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.recover_count == 1  # one fault


def test_a_node_already_known_or_unnamed_is_ignored() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.NodeDown(NodeName("node-1")))
    same = d.status
    assert rejected(d.feed(ev.NodeDown(NodeName("node-1")))) is act.RejectReason.IGNORED
    assert rejected(d.feed(ev.NodeDown(NodeName("")))) is act.RejectReason.IGNORED
    assert d.status is same and len(same.error_nodes) == 1


def test_a_node_down_after_the_job_ended_changes_nothing() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.QuitRequested())
    same = d.status
    assert rejected(d.feed(ev.NodeDown(NodeName("node-0")))) is act.RejectReason.TERMINAL
    assert d.status is same
