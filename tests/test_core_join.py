"""A pod sent away that does not come back in time (``JoinTimedOut``, core ``rounds.
replace_elsewhere``): its node joins the error nodes and the pod is placed elsewhere; nothing
more is counted, the phase stays. Found on the emulated cluster: a node cut off from the
network for longer than its agent's connect timeout left the job in Restarting for good."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import NodeName
from aegis.core.phases import Phase
from tests.core_helpers import Driver, rejected


def test_a_replacement_that_never_joins_blacklists_its_node_and_goes_elsewhere() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.HeartbeatLost(d.pod(1)))  # lost: counted once, replaced
    d.feed(ev.PodRestarted(d.pod(1), NodeName("node-1")))  # placed on its node again
    before = d.status
    actions = d.feed(ev.JoinTimedOut(d.pod(1), "did not come back within 60 s"))
    assert actions == (
        act.RecordFault(pod=d.pod(1), reason="did not come back within 60 s", counted=False),
        act.BlacklistNode(node=NodeName("node-1"), reason="did not come back within 60 s"),
        act.ReplacePod(pod=d.pod(1), reason="did not come back within 60 s"),
    )
    s = d.status
    assert [e.node for e in s.error_nodes] == ["node-1"]
    assert (s.phase, s.seq, s.recover_count, s.away, s.outstanding) == (
        before.phase, before.seq, before.recover_count, before.away, before.outstanding
    )  # fmt: skip
    assert d.inner(1) is Phase.RESTARTING and not s.pod_infos[d.pod(1)].finished
    d.feed(ev.PodRestarted(d.pod(1), NodeName("node-3")))  # elsewhere this time
    d.feed(ev.PodAcked(d.pod(1)))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.recover_count == 1  # one fault


def test_a_pod_that_is_back_or_unknown_is_not_moved() -> None:
    d = Driver()
    d.to_running()
    same = d.status
    assert rejected(d.feed(ev.JoinTimedOut(d.pod(0)))) is act.RejectReason.IGNORED
    assert d.status is same
    assert rejected(d.feed(ev.JoinTimedOut(ev.PodName("job-9")))) is act.RejectReason.UNKNOWN_POD


def test_a_pod_never_placed_is_asked_for_again_and_the_node_it_was_drained_from_stays_good() -> (
    None
):
    d = Driver(workers=2)
    d.to_running()
    d.feed(ev.DrainRequested((d.pod(1),), "maintenance"))
    d.feed(ev.CheckpointCommitted(step=10))  # it leaves at the commit, for a spare
    assert d.inner(1) is Phase.RESTARTING and not d.status.pod_infos[d.pod(1)].finished
    actions = d.feed(ev.JoinTimedOut(d.pod(1), "did not come back within 60 s"))
    assert [type(a) for a in actions] == [act.RecordFault, act.ReplacePod]  # asked again
    assert d.status.error_nodes == ()  # drained, not broken
    d.feed(ev.PodRestarted(d.pod(1), NodeName("node-9")))  # placed: its node is the one now
    actions = d.feed(ev.JoinTimedOut(d.pod(1), "did not come back within 60 s"))
    assert act.BlacklistNode(NodeName("node-9"), "did not come back within 60 s") in actions
