"""Restart or stop (issue 18): the same error at the same step in ``repeat_limit`` incarnations
in a row ends the job Failed with that verdict, long before the budget is spent; a fault at
another step, another error, or a fault of another kind in between starts the count again. A
peer's closed connection at the same step (the same crash, seen by another rank first) neither
starts it again nor hides the error that the run is about."""

from __future__ import annotations

import dataclasses

import pytest

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.core.recovery import NO_RUN, FaultClass, Run, run_after
from aegis.wire import eventlog, status_json
from tests.core_helpers import Driver

TRACEBACK = "python_traceback"


def _crash(d: Driver, step: int | None, reason: str = "ValueError: bad sample 4711") -> None:
    d.feed(ev.PodErrored(d.pod(1), d.status.phase, d.status.seq, reason, TRACEBACK, step))


def _peer_saw_it(d: Driver, step: int, port: int) -> None:
    """Rank 0's report of rank 1's crash reaches the master first: its connection closed (gloo
    names the peer's port, another each incarnation). It gets a round of checks; all pass."""
    reason = f"RuntimeError: [pair.cc:534] Connection closed by peer [10.0.0.2]:{port}"
    d.feed(ev.PodErrored(d.pod(0), d.status.phase, d.status.seq, reason, FaultClass.CONNECTION,
                         step))  # fmt: skip
    assert d.status.phase is Phase.TROUBLESHOOTING
    d.answer_all()


def test_the_same_error_at_the_same_step_three_times_stops_the_job() -> None:
    d = Driver(max_retry=10)
    d.to_running()
    for _ in range(2):
        _crash(d, 150)
        assert d.status.phase is Phase.RUN_COMMAND  # restarted in place
    assert d.status.repeat_count == 2
    _crash(d, 150)
    assert d.status.phase is Phase.FAILED and d.status.should_quit
    [end] = [a for a in d.actions if isinstance(a, act.EndJob)]
    assert end.reason == (
        "the same fault 3 times in a row at step 150 (ValueError: bad sample 4711): "
        "a restart does not fix it; stopping"
    )
    assert d.status.recover_count == 3  # three faults counted of a budget of ten
    assert d.status.pod_infos[d.pod(1)].last_failed_reason == end.reason  # aegis status


@pytest.mark.parametrize(
    "second",
    [
        (151, "ValueError: bad sample 4711"),  # another step
        (150, "KeyError: 'label'"),  # another error
        (None, "ValueError: bad sample 4711"),  # no step known
    ],
)
def test_a_fault_that_differs_starts_the_count_again(second: tuple[int | None, str]) -> None:
    d = Driver(max_retry=10)
    d.to_running()
    _crash(d, 150)
    _crash(d, 150)
    _crash(d, *second)
    assert d.status.phase is Phase.RUN_COMMAND
    assert d.status.repeat_count == (0 if second[0] is None else 1)
    _crash(d, 150)
    _crash(d, 150)
    assert d.status.phase is Phase.RUN_COMMAND  # two in a row again: not yet


def test_a_hang_in_between_breaks_the_run() -> None:
    d = Driver(max_retry=10)
    d.to_running()
    _crash(d, 150)
    _crash(d, 150)
    d.feed(ev.HangReported(d.pod(0), d.status.phase, d.status.seq, "hang", blame=False))
    assert d.status.repeat_count == 0
    d.answer_all()  # the round the hang opened: everyone healthy, back to training
    assert d.status.phase is Phase.RUN_COMMAND
    _crash(d, 150)
    assert d.status.phase is Phase.RUN_COMMAND and d.status.repeat_count == 1


def test_limit_zero_never_stops_and_the_budget_still_does() -> None:
    d = Driver(max_retry=4)
    d.spec = dataclasses.replace(d.spec, repeat_limit=0)
    d.to_running()
    for _ in range(4):
        _crash(d, 150)
        assert d.status.phase is Phase.RUN_COMMAND
    _crash(d, 150)
    assert d.status.phase is Phase.FAILED
    assert any(isinstance(a, act.EndJob) and "budget" in a.reason for a in d.actions)


def test_the_count_survives_the_status_record_and_old_logs_replay_without_the_rule() -> None:
    d = Driver(max_retry=10)
    d.to_running()
    _crash(d, 150)
    _crash(d, 150)
    spec, status = status_json.from_dict(status_json.to_dict(d.spec, d.status))
    assert (status.repeat_step, status.repeat_count) == (150, 2) and spec.repeat_limit == 3
    assert status == d.status
    old = '{"type":"JobCreated","spec":{"job":"j","namespace":"ns","worker_num":1,"max_retry":2},'
    old_spec, _, _ = eventlog.read(iter([old + '"ts":0}']))
    assert old_spec.repeat_limit == 0  # a log from before the rule: replays with the old rule


def test_when_the_budget_is_spent_by_the_same_fault_the_budget_says_it() -> None:
    d = Driver(max_retry=2)
    d.to_running()
    for _ in range(3):
        _crash(d, 150)
    assert d.status.phase is Phase.FAILED and d.status.recover_count == 3  # max_retry + 1
    assert any(isinstance(a, act.EndJob) and "budget" in a.reason for a in d.actions)


def test_a_peers_closed_connection_first_does_not_hide_the_repeated_error() -> None:
    d = Driver(max_retry=10)
    d.to_running()
    _crash(d, 150)
    _peer_saw_it(d, 150, 40001)  # the second incarnation's crash, as rank 0 saw it
    assert d.status.phase is Phase.RUN_COMMAND and d.status.repeat_count == 2
    _crash(d, 150)
    assert d.status.phase is Phase.FAILED
    [end] = [a for a in d.actions if isinstance(a, act.EndJob)]
    assert end.reason.startswith(
        "the same fault 3 times in a row at step 150 (ValueError: bad sample 4711)"
    )


def test_a_run_that_peers_began_takes_the_errors_name_and_another_step_begins_anew() -> None:
    d = Driver(max_retry=10)
    d.to_running()
    _peer_saw_it(d, 150, 40001)
    _peer_saw_it(d, 150, 40002)
    assert (d.status.repeat_step, d.status.repeat_reason, d.status.repeat_count) == (150, "", 2)
    _peer_saw_it(d, 151, 40003)  # another step: a run of one
    assert d.status.repeat_count == 1
    _peer_saw_it(d, 151, 40004)
    _crash(d, 151)  # the error itself, at the run's step: the run's third, and its name
    assert d.status.phase is Phase.FAILED
    [end] = [a for a in d.actions if isinstance(a, act.EndJob)]
    assert "3 times in a row at step 151 (ValueError: bad sample 4711)" in end.reason


CONN, TB = FaultClass.CONNECTION.value, TRACEBACK


@pytest.mark.parametrize(
    ("run", "fault", "after"),
    [
        (NO_RUN, (7, "E", TB), (7, "E", 1)),
        (NO_RUN, (7, "closed", CONN), (7, "", 1)),
        ((7, "E", 1), (7, "E", TB), (7, "E", 2)),
        ((7, "E", 2), (7, "closed", CONN), (7, "E", 3)),
        ((7, "", 2), (7, "E", TB), (7, "E", 3)),
        ((7, "E", 2), (7, "F", TB), (7, "F", 1)),  # another error
        ((7, "E", 2), (8, "closed", CONN), (8, "", 1)),  # another step
        ((7, "E", 2), (None, "E", TB), NO_RUN),  # no step known
        ((7, "E", 2), (7, "E", FaultClass.NCCL_TIMEOUT.value), (7, "E", 3)),
        ((7, "E", 2), (7, "E", FaultClass.GPU_XID.value), (7, "E", 3)),  # (its own words)
    ],
)
def test_the_run_after_a_fault(run: Run, fault: tuple[int | None, str, str], after: Run) -> None:
    assert run_after(run, *fault) == after
