"""Restart or stop (issue 18): the same error at the same step in ``repeat_limit`` incarnations
in a row ends the job Failed with that verdict, long before the budget is spent; a fault at
another step, another error, or a fault of another kind in between starts the count again."""

from __future__ import annotations

import dataclasses

import pytest

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.wire import eventlog, status_json
from tests.core_helpers import Driver

TRACEBACK = "python_traceback"


def _crash(d: Driver, step: int | None, reason: str = "ValueError: bad sample 4711") -> None:
    d.feed(ev.PodErrored(d.pod(1), d.status.phase, d.status.seq, reason, TRACEBACK, step))


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
