"""Table tests of ``step``: every transition of DESIGN section 3, no mocks."""

from __future__ import annotations

import dataclasses

import pytest

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.actions import RejectReason
from aegis.core.model import NodeName, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification, RecoveryLevel
from tests.core_helpers import HEALTHY, Driver, orders, rejected


def test_initial_status_is_pending_with_every_pod_pending() -> None:
    d = Driver(workers=3)
    assert d.status.phase is Phase.PENDING
    assert all(d.inner(r) is Phase.PENDING for r in range(3))
    assert d.status.recover_count == 0 and d.status.seq == 0 and not d.status.should_quit


def test_pending_goes_boot_checking_when_every_pod_acked() -> None:
    d = Driver(workers=3)
    d.feed(ev.PodAcked(d.pod(0)))
    d.feed(ev.PodAcked(d.pod(1)))
    assert d.status.phase is Phase.PENDING and d.status.outstanding == 1
    actions = d.feed(ev.PodAcked(d.pod(2)))
    assert d.status.phase is Phase.BOOT_CHECKING
    assert orders(actions) == ["bootcheck"]
    assert d.status.seq == 1


def test_ack_is_rejected_when_pod_already_acked() -> None:
    d = Driver()
    d.feed(ev.PodAcked(d.pod(0)))
    before = d.status
    assert rejected(d.feed(ev.PodAcked(d.pod(0)))) is RejectReason.DUPLICATE
    assert d.status is before


def test_event_from_unknown_pod_is_rejected() -> None:
    d = Driver()
    assert rejected(d.feed(ev.PodAcked(PodName("intruder")))) is RejectReason.UNKNOWN_POD
    assert rejected(d.feed(ev.HeartbeatLost(PodName("x")))) is RejectReason.UNKNOWN_POD


def test_boot_checking_goes_run_command_when_every_pod_passes() -> None:
    d = Driver()
    d.ack_all()
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert orders(d.actions) == ["run"]
    assert d.retries() == (0, 0, 0)


def test_bootcheck_failure_evicts_pod_and_blacklists_node_without_counting() -> None:
    d = Driver()
    d.ack_all()
    d.answer_all({1: Classification.HARDWARE})
    assert d.status.phase is Phase.BOOT_CHECKING
    evicts = [a for a in d.actions if isinstance(a, act.EvictPod)]
    assert [(e.pod, e.level, e.exit_code) for e in evicts] == [(d.pod(1), RecoveryLevel.NODE, 1)]
    assert [n.node for n in d.status.error_nodes] == ["node-1"]
    assert d.retries() == (0, 0, 0) and d.status.recover_count == 0
    # The replacement comes up elsewhere, ACKs, and a fresh bootcheck round runs for all.
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    assert d.status.pod_infos[d.pod(1)].node == "spare-0"
    actions = d.feed(ev.PodAcked(d.pod(1)))
    assert orders(actions) == ["bootcheck"] and d.status.seq == 2
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND


def test_bootcheck_error_marks_pod_for_exit_not_counted() -> None:
    d = Driver()
    d.ack_all()
    d.error(0, "gpu fell off the bus")
    d.answer_all()  # the others answer; pod 0's answer is a duplicate and rejected
    assert any(isinstance(a, act.EvictPod) for a in d.actions)
    assert d.status.recover_count == 0


def test_bootcheck_runtime_failure_restarts_container_without_blacklist() -> None:
    d = Driver()
    d.ack_all()
    d.answer_all({2: Classification.RUNTIME})
    evict = next(a for a in d.actions if isinstance(a, act.EvictPod))
    assert evict.level is RecoveryLevel.CONTAINER and evict.exit_code == 75
    assert d.status.error_nodes == ()


def test_run_command_succeeds_when_every_pod_exits_zero() -> None:
    d = Driver()
    d.to_running()
    d.finish(0)
    d.finish(1)
    assert d.status.phase is Phase.RUN_COMMAND
    actions = d.finish(2)
    assert d.status.phase is Phase.SUCCEED
    assert any(isinstance(a, act.EndJob) and a.phase is Phase.SUCCEED for a in actions)
    assert all(d.inner(r) is Phase.SUCCEED for r in range(3))


@pytest.mark.parametrize(
    "make_event",
    [
        lambda d: ev.PodErrored(d.pod(1), Phase.RUN_COMMAND, d.status.seq, "NCCL timeout"),
        lambda d: ev.PodFinished(d.pod(1), Phase.RUN_COMMAND, d.status.seq, 1),
        lambda d: ev.HangReported(d.pod(1), Phase.RUN_COMMAND, d.status.seq),
    ],
    ids=["error", "nonzero-exit", "hang"],
)
def test_fault_in_run_command_counts_and_goes_troubleshooting(make_event) -> None:  # type: ignore[no-untyped-def]
    d = Driver()
    d.to_running()
    actions = d.feed(make_event(d))
    assert d.status.phase is Phase.TROUBLESHOOTING
    assert d.retries() == (0, 1, 0) and d.status.recover_count == 1
    assert orders(actions) == ["troubleshoot"]
    assert any(isinstance(a, act.RecordFault) and a.counted for a in actions)


def test_software_fault_restarts_every_pod_in_place_without_a_round() -> None:
    d = Driver()
    d.to_running()
    seq = d.status.seq
    error = ev.PodErrored(
        d.pod(1), Phase.RUN_COMMAND, seq, "ValueError: bad batch", "python_traceback"
    )
    actions = d.feed(error)
    assert d.status.phase is Phase.RUN_COMMAND and d.status.seq == seq + 1
    assert orders(actions) == ["restart"]
    assert d.retries() == (1, 1, 1) and d.status.recover_count == 1  # counted, then aligned
    [record] = [a for a in actions if isinstance(a, act.RecordFault)]
    assert record.counted and record.pod == d.pod(1)
    assert d.status.pod_infos[d.pod(1)].last_failed_reason == "ValueError: bad batch"
    # the other ranks' reports of the same crash (a peer vanished) answer the old round
    late = ev.PodErrored(d.pod(0), Phase.RUN_COMMAND, seq, "connection: reset", "connection")
    assert rejected(d.feed(late)) is RejectReason.STALE
    assert d.status.recover_count == 1


@pytest.mark.parametrize("fault_class", ["", "connection", "nccl_timeout", "lustre_eio"])
def test_a_fault_not_named_software_still_gets_the_checks(fault_class: str) -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.PodErrored(d.pod(1), Phase.RUN_COMMAND, d.status.seq, "exit status 1", fault_class))
    assert d.status.phase is Phase.TROUBLESHOOTING


def test_a_job_without_software_restarts_checks_after_every_fault() -> None:
    d = Driver()
    d.spec = dataclasses.replace(
        d.spec, software_restart=False
    )  # aegis run --checks-on-every-fault
    d.to_running()
    d.feed(ev.PodErrored(d.pod(1), Phase.RUN_COMMAND, d.status.seq, "KeyError", "python_traceback"))
    assert d.status.phase is Phase.TROUBLESHOOTING


def test_software_fault_past_the_budget_fails_the_job() -> None:
    d = Driver(max_retry=1)
    d.to_running()
    for expected in (Phase.RUN_COMMAND, Phase.FAILED):
        d.feed(ev.PodErrored(d.pod(0), d.status.phase, d.status.seq, "boom", "python_traceback"))
        assert d.status.phase is expected
    assert d.status.should_quit and d.status.recover_count == 2
    assert any(isinstance(a, act.EndJob) and "budget" in a.reason for a in d.actions)


def test_software_fault_while_checking_is_still_an_answer_that_evicts() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.feed(ev.PodErrored(d.pod(2), Phase.TROUBLESHOOTING, d.status.seq, "x", "python_traceback"))
    d.answer_all()
    assert d.status.phase is Phase.RESTARTING  # pod 2's check run crashed: it leaves its node


def test_hang_marks_pod_slow() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.HangReported(d.pod(2), Phase.RUN_COMMAND, d.status.seq))
    assert d.status.pod_infos[d.pod(2)].slow and d.status.slow_count == 1


def test_lost_heartbeat_in_run_command_counts_and_goes_restarting() -> None:
    d = Driver()
    d.to_running()
    actions = d.feed(ev.HeartbeatLost(d.pod(0)))
    assert d.status.phase is Phase.RESTARTING
    assert d.retries() == (1, 0, 0)
    assert orders(actions) == ["stop"]
    assert any(isinstance(a, act.ReplacePod) and a.pod == d.pod(0) for a in actions)
    # Losing it again while it is being replaced changes nothing.
    assert rejected(d.feed(ev.HeartbeatLost(d.pod(0)))) is RejectReason.IGNORED


def test_restarting_goes_troubleshooting_when_replaced_pod_is_back_and_acked() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.HeartbeatLost(d.pod(0)))
    d.feed(ev.PodRestarted(d.pod(0), node=NodeName("spare-0")))
    assert d.status.phase is Phase.RESTARTING and d.inner(0) is Phase.PENDING
    actions = d.feed(ev.PodAcked(d.pod(0)))
    assert d.status.phase is Phase.TROUBLESHOOTING
    assert orders(actions) == ["troubleshoot"]


def test_pod_restart_in_run_command_counts_and_waits_for_its_ack() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.PodRestarted(d.pod(2)))
    assert d.status.phase is Phase.RESTARTING and d.retries() == (0, 0, 1)
    d.feed(ev.PodAcked(d.pod(2)))
    assert d.status.phase is Phase.TROUBLESHOOTING


def test_troubleshooting_all_healthy_restarts_in_place_and_aligns_retries() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert orders(d.actions) == ["restart"]
    assert d.retries() == (1, 1, 1) and d.status.recover_count == 1


def test_troubleshooting_error_marks_pod_for_exit_not_counted() -> None:
    """Rule 6: an Error during the troubleshoot round makes that pod leave; no fault counted."""
    d = Driver()
    d.to_running()
    d.error(0)  # the fault: counted once
    assert d.status.phase is Phase.TROUBLESHOOTING and d.retries() == (1, 0, 0)
    d.error(2, "the checks crashed")
    assert d.retries() == (1, 0, 0) and d.status.recover_count == 1  # not counted
    d.feed(ev.ChecksReported(d.pod(0), d.status.phase, d.status.seq, HEALTHY, "ok"))
    actions = d.feed(ev.ChecksReported(d.pod(1), d.status.phase, d.status.seq, HEALTHY, "ok"))
    assert d.status.phase is Phase.RESTARTING  # the round resolved: pod 2 must leave
    evicts = [a for a in actions if isinstance(a, act.EvictPod)]
    assert [e.pod for e in evicts] == [d.pod(2)]
    assert [d.inner(r) for r in range(3)] == [Phase.RESTARTING] * 3
    assert not d.status.pod_infos[d.pod(2)].finished  # away, awaiting its replacement
    assert d.status.recover_count == 1 and d.retries() == (1, 0, 0)


def test_troubleshooting_hardware_fault_evicts_to_restarting_then_back() -> None:
    d = Driver()
    d.to_running()
    d.error(1)
    d.answer_all({1: Classification.HARDWARE})
    assert d.status.phase is Phase.RESTARTING
    assert [n.node for n in d.status.error_nodes] == ["node-1"]
    assert any(isinstance(a, act.BlacklistNode) for a in d.actions)
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    d.feed(ev.PodAcked(d.pod(1)))
    assert d.status.phase is Phase.TROUBLESHOOTING
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND and d.retries() == (1, 1, 1)


def test_troubleshooting_slow_verdict_marks_then_evicts_at_next_checkpoint() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.answer_all({2: Classification.SLOW})
    assert d.status.phase is Phase.RUN_COMMAND  # marked, not killed
    assert d.status.pod_infos[d.pod(2)].slow
    actions = d.feed(ev.CheckpointCommitted(step=100))
    assert d.status.phase is Phase.RESTARTING
    evict = next(a for a in actions if isinstance(a, act.EvictPod))
    assert evict.pod == d.pod(2) and evict.level is RecoveryLevel.EVICT_SLOW
    assert [n.node for n in d.status.error_nodes] == ["node-2"]
    assert d.status.recover_count == 1  # eviction is not a fault


def test_slowdown_runs_the_checks_without_counting_then_the_slow_pod_leaves_at_a_checkpoint() -> (
    None
):
    d = Driver()
    d.to_running()
    actions = d.feed(ev.SlowdownReported("3.1 steps/s, below 30% of 20 steps/s"))
    assert d.status.phase is Phase.TROUBLESHOOTING and orders(actions) == ["troubleshoot"]
    assert not any(isinstance(a, act.RecordFault) for a in actions)
    d.answer_all({1: Classification.SLOW})
    assert d.status.phase is Phase.RUN_COMMAND and d.status.pod_infos[d.pod(1)].slow
    assert d.status.recover_count == 0 and d.retries() == (0, 0, 0)
    # while the marked pod waits for its checkpoint, the run is slow: no second round
    assert rejected(d.feed(ev.SlowdownReported())) is RejectReason.IGNORED
    evict = next(a for a in d.feed(ev.CheckpointCommitted(step=9)) if isinstance(a, act.EvictPod))
    assert evict.pod == d.pod(1) and evict.level is RecoveryLevel.EVICT_SLOW
    assert d.status.recover_count == 0


def test_slowdown_with_every_pod_healthy_restarts_in_place_and_counts_nothing() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.SlowdownReported())
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND and orders(d.actions) == ["restart"]
    assert d.status.recover_count == 0 and d.status.slow_count == 0


def test_slowdown_outside_run_command_or_once_a_pod_finished_is_ignored() -> None:
    d = Driver()
    d.ack_all()
    assert rejected(d.feed(ev.SlowdownReported())) is RejectReason.IGNORED
    assert d.status.phase is Phase.BOOT_CHECKING
    d.answer_all()
    d.finish(0)  # the job is ending: the others finish later, the pace falls
    assert rejected(d.feed(ev.SlowdownReported())) is RejectReason.IGNORED
    assert d.status.phase is Phase.RUN_COMMAND


def test_checkpoint_with_no_slow_pod_changes_nothing() -> None:
    d = Driver()
    d.to_running()
    before = d.status
    assert rejected(d.feed(ev.CheckpointCommitted(step=5))) is RejectReason.IGNORED
    assert d.status is before


def test_troubleshooting_fails_job_when_retries_exceed_max_retry() -> None:
    d = Driver(workers=2, max_retry=0)
    d.to_running()
    d.error(0)
    assert d.retries() == (1, 0) and d.status.recover_count == 0
    d.answer_all()
    assert d.status.phase is Phase.FAILED and d.status.should_quit
    assert d.status.recover_count == 1  # max_retry + 1


def test_should_quit_fails_job_from_any_non_terminal_phase() -> None:
    for setup in ("pending", "boot", "run", "trouble", "restarting"):
        d = Driver()
        if setup != "pending":
            d.ack_all()
        if setup in ("run", "trouble", "restarting"):
            d.answer_all()
        if setup == "trouble":
            d.error(0)
        if setup == "restarting":
            d.feed(ev.HeartbeatLost(d.pod(0)))
        rc = d.status.recover_count
        actions = d.feed(ev.QuitRequested("user"))
        assert d.status.phase is Phase.FAILED and d.status.should_quit, setup
        assert d.status.recover_count == rc
        assert any(isinstance(a, act.EndJob) for a in actions)


def test_terminal_phases_absorb_every_event() -> None:
    d = Driver()
    d.feed(ev.QuitRequested())
    before = d.status
    for event in (ev.PodAcked(d.pod(0)), ev.HeartbeatLost(d.pod(1)), ev.QuitRequested()):
        assert rejected(d.feed(event)) is RejectReason.TERMINAL
    assert d.status is before


def test_stale_seq_message_changes_nothing() -> None:
    d = Driver()
    d.to_running()
    before = d.status
    stale = ev.PodErrored(d.pod(0), Phase.RUN_COMMAND, d.status.seq - 1, "old")
    assert rejected(d.feed(stale)) is RejectReason.STALE
    future = ev.PodErrored(d.pod(0), Phase.RUN_COMMAND, d.status.seq + 1, "forged")
    assert rejected(d.feed(future)) is RejectReason.STALE
    wrong_phase = ev.PodErrored(d.pod(0), Phase.BOOT_CHECKING, d.status.seq, "old phase")
    assert rejected(d.feed(wrong_phase)) is RejectReason.STALE
    assert d.status is before


def test_duplicate_finish_is_processed_once() -> None:
    d = Driver()
    d.to_running()
    d.finish(0)
    after_first = d.status
    assert rejected(d.finish(0)) is RejectReason.DUPLICATE
    assert d.status is after_first and d.status.outstanding == 2


def test_ack_of_restarted_pod_is_accepted_whatever_its_seq_pending_exception() -> None:
    d = Driver()
    d.to_running()
    d.error(0)  # Troubleshooting, seq 3
    d.feed(ev.PodRestarted(d.pod(1)))  # not counted outside RunCommand
    assert d.retries() == (1, 0, 0) and d.inner(1) is Phase.PENDING
    actions = d.feed(ev.PodAcked(d.pod(1)))
    assert orders(actions) == ["troubleshoot"]


def test_message_for_wrong_phase_is_rejected() -> None:
    d = Driver()
    d.ack_all()  # BootChecking
    finished = ev.PodFinished(d.pod(0), Phase.BOOT_CHECKING, d.status.seq, 0)
    assert rejected(d.feed(finished)) is RejectReason.WRONG_PHASE
    hang = ev.HangReported(d.pod(0), Phase.BOOT_CHECKING, d.status.seq)
    assert rejected(d.feed(hang)) is RejectReason.WRONG_PHASE


def test_recover_count_is_capped_at_max_retry() -> None:
    d = Driver(workers=3, max_retry=1)
    d.to_running()
    d.error(0)
    d.answer_all()
    d.error(1)
    assert d.retries() == (1, 2, 1)
    assert d.status.recover_count == 1  # min(2, max_retry)


def test_slow_mark_does_not_follow_a_pod_replaced_for_hardware() -> None:
    """Found by the simulator: a hung pod replaced for a hardware fault must not have its
    healthy replacement evicted at the next checkpoint."""
    d = Driver(workers=2, max_retry=5)
    d.to_running()
    d.feed(ev.HangReported(d.pod(0), Phase.RUN_COMMAND, d.status.seq))
    d.answer_all({0: Classification.HARDWARE})
    assert d.status.phase is Phase.RESTARTING and d.status.slow_count == 0
    d.feed(ev.PodRestarted(d.pod(0), node=NodeName("spare-0")))
    d.feed(ev.PodAcked(d.pod(0)))
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert rejected(d.feed(ev.CheckpointCommitted(step=1))) is RejectReason.IGNORED
