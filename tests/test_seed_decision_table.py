"""The seed's decision table (section 5.4), the rows that concern the master, and the seed's
worked example of fault counting (section 5.2), exactly."""

from __future__ import annotations

from pathlib import Path

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import NodeName, retries_of
from aegis.core.phases import Phase
from aegis.core.recovery import Classification
from aegis.tools import replay
from tests.core_helpers import Driver

TRACE = Path(__file__).parent.parent / "examples" / "traces" / "seed-worked-example.jsonl"


def test_row_bootcheck_gpu_lost_exits_1_and_reports_error_node() -> None:
    d = Driver()
    d.ack_all()
    d.answer_all({0: Classification.HARDWARE})
    evict = next(a for a in d.actions if isinstance(a, act.EvictPod))
    assert evict.exit_code == 1 and [n.node for n in d.status.error_nodes] == ["node-0"]


def test_row_bootcheck_wrong_command_passes_checks_and_fails_in_run_command() -> None:
    d = Driver()
    d.to_running()  # the checks cannot see a wrong command: bootcheck passes
    d.finish(0, code=127)  # then the command fails and that is an ordinary counted fault
    assert d.status.phase is Phase.TROUBLESHOOTING and d.retries() == (1, 0, 0)


def test_row_run_command_gpu_lost_reports_failure_and_waits_for_troubleshooting() -> None:
    d = Driver()
    d.to_running()
    d.error(2, "CUDA error: GPU has fallen off the bus")
    assert d.status.phase is Phase.TROUBLESHOOTING
    d.answer_all({2: Classification.HARDWARE})
    assert d.status.phase is Phase.RESTARTING
    assert [n.node for n in d.status.error_nodes] == ["node-2"]


def test_row_run_command_pod_force_deleted_counts_and_reruns_after_restart() -> None:
    d = Driver()
    d.to_running()
    d.feed(ev.HeartbeatLost(d.pod(1)))
    assert d.retries() == (0, 1, 0)
    d.feed(ev.PodRestarted(d.pod(1), node=NodeName("spare-0")))
    d.feed(ev.PodAcked(d.pod(1)))
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND and d.retries() == (1, 1, 1)


def test_row_troubleshooting_gpu_lost_exits_1_and_reports_error_node() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.answer_all({1: Classification.HARDWARE})
    evict = next(a for a in d.actions if isinstance(a, act.EvictPod))
    assert evict.pod == d.pod(1) and evict.exit_code == 1
    assert d.retries() == (1, 0, 0)  # not counted


def test_row_troubleshooting_wrong_command_on_healthy_node_continues_run_command() -> None:
    d = Driver()
    d.to_running()
    d.finish(1, code=2)
    d.answer_all()
    assert d.status.phase is Phase.RUN_COMMAND
    assert [a.order.value for a in d.actions if isinstance(a, act.SendOrder)] == ["restart"]


def test_row_troubleshooting_network_cut_pod_replaced_without_count() -> None:
    d = Driver()
    d.to_running()
    d.error(0)
    d.feed(ev.HeartbeatLost(d.pod(2)))  # silent pod during troubleshooting
    assert d.retries() == (1, 0, 0)
    assert any(isinstance(a, act.ReplacePod) for a in d.actions)


def test_seed_worked_example_counts_exactly() -> None:
    d = Driver(workers=3, max_retry=2)
    d.to_running()
    seen = []
    d.error(0, "worker 0 killed")
    seen.append((d.retries(), d.status.recover_count))
    d.feed(ev.PodRestarted(d.pod(1)))  # dies during troubleshooting: not counted
    seen.append((d.retries(), d.status.recover_count))
    d.feed(ev.PodAcked(d.pod(1)))
    d.answer_all()
    seen.append((d.retries(), d.status.recover_count))
    d.error(1, "internal error")
    seen.append((d.retries(), d.status.recover_count))
    d.answer_all()
    seen.append((d.retries(), d.status.recover_count))
    d.error(2, "again")
    seen.append((d.retries(), d.status.recover_count))
    assert seen == [
        ((1, 0, 0), 1),
        ((1, 0, 0), 1),
        ((1, 1, 1), 1),
        ((1, 2, 1), 2),
        ((2, 2, 2), 2),
        ((2, 2, 3), 2),
    ]
    d.answer_all()
    assert d.status.phase is Phase.FAILED and d.status.recover_count == 3
    assert d.status.should_quit


def test_seed_worked_example_trace_replays_to_the_same_counts() -> None:
    _, _, steps = replay.replay(TRACE.read_text().splitlines())
    history = [(retries_of(s.status), s.status.recover_count, s.status.phase) for s in steps]
    distinct = []
    for retries, rc, phase in history:
        if phase is Phase.FAILED:
            distinct.append("Failed")
            break
        if retries != (0, 0, 0) and (not distinct or distinct[-1] != (retries, rc)):
            distinct.append((retries, rc))
    assert distinct == [
        ((1, 0, 0), 1),
        ((1, 1, 1), 1),
        ((1, 2, 1), 2),
        ((2, 2, 2), 2),
        ((2, 2, 3), 2),
        "Failed",
    ]
    assert history[-1][1] == 3
