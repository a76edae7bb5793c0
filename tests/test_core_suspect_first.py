"""The suspect's node is checked first (issue 18): a troubleshooting round ends as soon as the
pod a hang's stacks named answers that it must leave; its peers' answers are then stale."""

from __future__ import annotations

import pytest

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.actions import RejectReason
from aegis.core.model import NodeName
from aegis.core.phases import Order, Phase
from aegis.core.recovery import Classification, RecoveryLevel
from tests.core_helpers import Driver, orders, rejected


def _hung_round(d: Driver, rank: int) -> int:
    """Training runs, the hang's stacks name ``rank``: the troubleshooting round it starts."""
    d.to_running()
    d.feed(ev.HangReported(d.pod(rank), Phase.RUN_COMMAND, d.status.seq, "hang", blame=True))
    assert d.status.phase is Phase.TROUBLESHOOTING
    return d.status.seq


@pytest.mark.parametrize(
    ("verdict", "level"),
    [
        (Classification.HARDWARE, RecoveryLevel.NODE),
        (Classification.RUNTIME, RecoveryLevel.CONTAINER),
    ],
)
def test_the_suspects_answer_that_it_must_leave_ends_the_round_at_once(
    verdict: Classification, level: RecoveryLevel
) -> None:
    d = Driver(workers=4)
    seq = _hung_round(d, 2)
    actions = d.feed(ev.ChecksReported(d.pod(2), Phase.TROUBLESHOOTING, seq, verdict, "gpu"))
    assert d.status.phase is Phase.RESTARTING
    assert [a.level for a in actions if isinstance(a, act.EvictPod)] == [level]
    assert d.status.pod_infos[d.pod(2)].inner_phase is Phase.RESTARTING
    assert d.retries() == (0, 0, 1, 0)  # the hang counted once, for the suspect
    # the peers that were still checking answer too late: stale, nothing changes
    before = d.status
    late = d.feed(ev.ChecksReported(d.pod(0), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert rejected(late) is RejectReason.STALE and d.status is before


def test_the_suspect_leaves_and_the_next_round_checks_everyone_with_its_replacement() -> None:
    d = Driver(workers=3)
    seq = _hung_round(d, 1)
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert [n.node for n in d.status.error_nodes] == ["node-1"]
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    actions = d.feed(ev.PodAcked(d.pod(1)))
    assert orders(actions) == [Order.TROUBLESHOOT.value]
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert not d.status.pod_infos[d.pod(1)].slow  # the mark stayed with the node it left


def test_a_suspect_found_only_slow_waits_for_its_peers() -> None:
    d = Driver(workers=3)
    seq = _hung_round(d, 1)
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.SLOW))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.outstanding == 2


def test_a_pod_that_is_not_suspected_waits_for_its_peers_even_when_it_must_leave() -> None:
    d = Driver(workers=3)
    seq = _hung_round(d, 1)
    d.feed(ev.ChecksReported(d.pod(0), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.outstanding == 2
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.RESTARTING  # the suspect decided; pod 0's answer counts too
    assert sorted(n.node for n in d.status.error_nodes) == ["node-0", "node-1"]


def test_a_hang_with_no_suspect_waits_for_every_answer() -> None:
    d = Driver(workers=3)
    d.to_running()
    d.feed(ev.HangReported(d.pod(1), Phase.RUN_COMMAND, d.status.seq, "hang", blame=False))
    seq = d.status.seq
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.outstanding == 2


def test_the_suspect_that_must_leave_with_the_budget_spent_fails_the_job() -> None:
    d = Driver(workers=3, max_retry=0)
    seq = _hung_round(d, 1)
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.FAILED


def test_a_round_with_a_pod_away_waits_for_it_even_when_the_suspect_must_leave() -> None:
    """A pod lost during the round is being replaced: ending the round on the suspect's answer
    would count it as present (it waits, and the round starts again once it is back)."""
    d = Driver(workers=3)
    seq = _hung_round(d, 1)
    d.feed(ev.HeartbeatLost(d.pod(2)))
    assert d.status.away == 1
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.away == 1
    assert not d.status.pod_infos[d.pod(2)].finished
    d.feed(ev.PodRestarted(d.pod(2), node=NodeName("spare-0")))
    actions = d.feed(ev.PodAcked(d.pod(2)))
    assert orders(actions) == [Order.TROUBLESHOOT.value]  # a fresh round, everyone present
    fresh = d.status.seq
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, fresh, Classification.HARDWARE))
    assert d.status.phase is Phase.RESTARTING  # now the suspect's answer ends it


def test_a_draining_pod_that_had_not_answered_leaves_with_the_suspect() -> None:
    """Training is stopped anyway: a drained node's pod leaves when the round ends, even when
    the suspect's answer ended it before the drained pod answered."""
    d = Driver(workers=3)
    seq = _hung_round(d, 1)
    d.feed(ev.DrainRequested((d.pod(2),), "bios update"))
    d.feed(ev.ChecksReported(d.pod(1), Phase.TROUBLESHOOTING, seq, Classification.HARDWARE))
    assert d.status.phase is Phase.RESTARTING
    levels = {a.pod: a.level for a in d.actions if isinstance(a, act.EvictPod)}
    assert levels == {d.pod(1): RecoveryLevel.NODE, d.pod(2): RecoveryLevel.DRAIN}
