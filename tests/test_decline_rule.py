"""When the training is taken not to answer a checkpoint request (the pure rule)."""

from __future__ import annotations

from aegis.agent.decline_rule import declines


def test_a_script_stepping_past_the_request_without_taking_it_declines() -> None:
    assert not declines(10, 11, True, 0.5, 5.0)
    assert declines(10, 12, True, 0.5, 5.0)


def test_a_script_that_never_stepped_declines_after_its_silence() -> None:
    assert not declines(None, None, False, 4.9, 5.0)
    assert declines(None, None, False, 5.1, 5.0)


def test_a_script_that_stepped_before_is_waited_for_while_it_restarts() -> None:
    assert not declines(None, None, True, 600.0, 5.0)
    assert not declines(40, None, True, 600.0, 5.0)


def test_a_look_counts_from_the_first_step_seen_and_stops_once_requests_are_taken() -> None:
    from aegis.agent import decline_rule
    from aegis.agent.ports import Progress

    wait, declined = decline_rule.Verdict.WAIT, decline_rule.Verdict.DECLINED
    assert decline_rule.look(None, Progress(), 1.0, 5.0) == (None, wait)
    assert decline_rule.look(None, Progress(step=7, ever_stepped=True), 1.0, 5.0) == (7, wait)
    assert decline_rule.look(7, Progress(step=9, ever_stepped=True), 1.0, 5.0) == (7, declined)
    assert decline_rule.look(None, Progress(), 6.0, 5.0) == (None, declined)  # silent
    taken = Progress(step=9, ever_stepped=True, takes_checkpoint_requests=True)
    assert decline_rule.look(7, taken, 60.0, 5.0) == (7, decline_rule.Verdict.TAKEN)
