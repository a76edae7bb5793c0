"""The core's drain (planned maintenance): pods of a drained node leave at the next committed
checkpoint, or when the deadline passes, or when a check round resolves; never counted."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.actions import RejectReason
from aegis.core.model import NodeName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification, RecoveryLevel
from tests.core_helpers import Driver, orders, rejected


def evictions(actions: tuple[act.Action, ...]) -> list[tuple[str, RecoveryLevel]]:
    return [(a.pod, a.level) for a in actions if isinstance(a, act.EvictPod)]


def test_drain_in_run_command_marks_and_evicts_at_the_next_checkpoint_without_a_fault() -> None:
    d = Driver()
    d.to_running()
    assert d.feed(ev.DrainRequested((d.pod(1),), "kernel upgrade")) == ()
    info = d.status.pod_infos[d.pod(1)]
    assert info.drain and d.status.drain_count == 1 and d.status.phase is Phase.RUN_COMMAND
    assert info.last_failed_reason == "drain: kernel upgrade"
    actions = d.feed(ev.CheckpointCommitted(step=12))
    assert d.status.phase is Phase.RESTARTING and orders(actions) == ["stop"]
    assert evictions(actions) == [(d.pod(1), RecoveryLevel.DRAIN)]
    assert not any(isinstance(a, act.BlacklistNode | act.RecordFault) for a in actions)
    assert d.status.error_nodes == ()  # a drained node is not a broken one
    assert d.status.drain_count == 0 and not d.status.pod_infos[d.pod(1)].drain
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    d.feed(ev.PodAcked(d.pod(1)))
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert d.retries() == (0, 0, 0) and d.status.recover_count == 0


def test_drain_forced_evicts_at_once_and_only_the_draining_pods() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.DrainRequested((d.pod(2),), "maintenance"))
    actions = d.feed(ev.DrainForced((d.pod(0), d.pod(2)), "deadline 30 s passed"))
    assert evictions(actions) == [(d.pod(2), RecoveryLevel.DRAIN)]
    assert d.status.phase is Phase.RESTARTING and d.status.recover_count == 0
    reason = next(a.reason for a in actions if isinstance(a, act.EvictPod))
    assert reason == "drain: maintenance (deadline 30 s passed)"


def test_drain_forced_without_a_draining_pod_changes_nothing() -> None:
    d = Driver()
    d.to_running()
    before = d.status
    assert rejected(d.feed(ev.DrainForced((d.pod(0),)))) is RejectReason.IGNORED
    assert d.status is before


def test_drain_of_unknown_or_already_draining_pods_is_ignored() -> None:
    d = Driver()
    d.to_running()
    assert rejected(d.feed(ev.DrainRequested(()))) is RejectReason.IGNORED
    d.feed(ev.DrainRequested((d.pod(0),)))
    before = d.status
    assert rejected(d.feed(ev.DrainRequested((d.pod(0),)))) is RejectReason.IGNORED
    assert d.status is before


def test_drain_during_troubleshooting_leaves_when_the_round_resolves() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    assert d.status.phase is Phase.TROUBLESHOOTING and d.status.recover_count == 1
    d.feed(ev.DrainRequested((d.pod(2),), "maintenance"))
    assert d.status.phase is Phase.TROUBLESHOOTING
    d.answer_all()
    assert evictions(d.actions) == [(d.pod(2), RecoveryLevel.DRAIN)]
    assert d.status.phase is Phase.RESTARTING
    assert d.status.recover_count == 1 and d.retries() == (1, 0, 0)  # only the crash counted


def test_a_bad_node_verdict_outranks_the_drain() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.feed(ev.DrainRequested((d.pod(2),)))
    d.answer_all({2: Classification.HARDWARE})
    assert evictions(d.actions) == [(d.pod(2), RecoveryLevel.NODE)]
    assert [n.node for n in d.status.error_nodes] == ["node-2"]


def test_drain_before_training_leaves_at_the_end_of_bootcheck() -> None:
    d = Driver()
    d.ack_all()
    d.feed(ev.DrainRequested((d.pod(1),), "maintenance"))
    d.answer_all()
    assert d.status.phase is Phase.BOOT_CHECKING
    assert evictions(d.actions) == [(d.pod(1), RecoveryLevel.DRAIN)]
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    d.feed(ev.PodAcked(d.pod(1)))
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND and d.status.recover_count == 0


def test_a_draining_pod_replaced_elsewhere_loses_the_mark() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.DrainRequested((d.pod(1),)))
    d.feed(ev.HeartbeatLost(d.pod(1)))  # a real fault while draining: counted as usual
    assert d.status.recover_count == 1 and d.status.drain_count == 1
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    assert d.status.drain_count == 0 and not d.status.pod_infos[d.pod(1)].drain


def test_slow_and_draining_pods_leave_at_the_same_checkpoint() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.answer_all({1: Classification.SLOW})
    d.feed(ev.DrainRequested((d.pod(2),)))
    actions = d.feed(ev.CheckpointCommitted(step=20))
    assert sorted(evictions(actions)) == [
        (d.pod(1), RecoveryLevel.EVICT_SLOW),
        (d.pod(2), RecoveryLevel.DRAIN),
    ]
    assert [n.node for n in d.status.error_nodes] == ["node-1"]  # the slow one only
    assert d.status.slow_count == 0 and d.status.drain_count == 0


def test_a_software_fault_lets_the_draining_pods_leave_at_once() -> None:
    """Training stopped anyway: the drained node's pod leaves now, not at the next commit."""
    d = Driver()
    d.to_running()
    d.feed(ev.DrainRequested((d.pod(2),), "kernel upgrade"))
    actions = d.feed(
        ev.PodErrored(d.pod(0), Phase.RUN_COMMAND, d.status.seq, "KeyError", "python_traceback")
    )
    assert d.status.phase is Phase.RESTARTING and d.status.recover_count == 1
    evict = next(a for a in actions if isinstance(a, act.EvictPod))
    assert evict.pod == d.pod(2) and evict.level is RecoveryLevel.DRAIN
    assert d.status.error_nodes == ()  # a drain blacklists nothing
