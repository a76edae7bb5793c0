"""How a job ended, read from its final status (``aegis.core.endings``), on statuses the real
state machine made: every pod done, the budget spent, the repeat rule, a stop from outside."""

from __future__ import annotations

import dataclasses

import pytest

from aegis.core import events as ev
from aegis.core.endings import Ending, ending, restarts
from aegis.core.phases import Phase
from tests.core_helpers import Driver

TRACEBACK = "python_traceback"


def _crash(d: Driver, step: int | None) -> None:
    d.feed(ev.PodErrored(d.pod(1), d.status.phase, d.status.seq, "ValueError: bad", TRACEBACK,
                         step))  # fmt: skip


def test_a_running_job_has_not_ended_and_one_whose_pods_all_finished_succeeded() -> None:
    d = Driver()
    assert ending(d.spec, d.status) is None
    d.to_running()
    assert ending(d.spec, d.status) is None
    for rank in range(3):
        d.finish(rank)
    assert d.status.phase is Phase.SUCCEED
    assert ending(d.spec, d.status) is Ending.SUCCEEDED


def test_faults_past_the_budget_exhaust_it() -> None:
    d = Driver(max_retry=1)
    d.to_running()
    for _ in range(10):
        if d.status.phase is Phase.FAILED:
            break
        if d.status.phase is Phase.RUN_COMMAND:
            d.error(1)
        else:
            d.answer_all()
    assert d.status.phase is Phase.FAILED
    assert ending(d.spec, d.status) is Ending.BUDGET_EXHAUSTED


@pytest.mark.parametrize(
    ("max_retry", "crashes", "stop", "expected"),
    [
        (10, 3, False, Ending.REPEATED_FAULT),  # the same fault three times, budget left
        (2, 3, False, Ending.BUDGET_EXHAUSTED),  # the third spends the budget: said first
        (10, 2, True, Ending.STOPPED),  # a stop from outside during a run of the same fault
    ],
)
def test_a_run_of_the_same_fault_ends_by_the_repeat_rule_only_with_budget_left(
    max_retry: int, crashes: int, stop: bool, expected: Ending
) -> None:
    d = Driver(max_retry=max_retry)
    d.to_running()
    for _ in range(crashes):
        assert ending(d.spec, d.status) is None
        _crash(d, 150)
    if stop:
        d.feed(ev.QuitRequested("stopped by aegis ctl"))
    assert d.status.phase is Phase.FAILED
    assert ending(d.spec, d.status) is expected


def test_a_failed_status_without_should_quit_is_only_failed() -> None:
    """Not a status the core makes (FailedMeansShouldQuit): a hand-made or damaged record."""
    d = Driver()
    broken = dataclasses.replace(d.status, phase=Phase.FAILED, recover_count=1)
    assert ending(d.spec, broken) is Ending.FAILED


@pytest.mark.parametrize(
    ("max_retry", "crashes", "restarted"),
    [
        (10, 3, 2),  # stopped by the repeat rule at its third fault: two restarts
        (3, 3, 2),  # the same, with a budget that the third fault just reached
        (2, 3, 2),  # the third spent the budget: two restarts, the budget's all
        (10, 2, 2),  # still running after two restarts
    ],
)
def test_restarted_counts_the_faults_that_were_restarted(
    max_retry: int, crashes: int, restarted: int
) -> None:
    """The seed's "restarted M times" (``aegis status``, an AegisJob's message). A job that the
    repeat rule stopped at its third fault said "restarted 3 times" after two restarts."""
    d = Driver(max_retry=max_retry)
    d.to_running()
    for _ in range(crashes):
        _crash(d, 150)
    assert restarts(d.spec, d.status) == restarted
