"""allreduce_perf's compute rating (checks/perf.py) is robust to a loaded machine: the second best
over rounds, every pod measuring at once, of the pod's ratio to its peers' median in that
round."""

from __future__ import annotations

import types

import pytest

from aegis.checks import perf


def rounds_of(*per_rank: list[float]) -> list[list[float]]:
    """Per-rank figures of each round -> per-round figures of each rank."""
    return [list(figures) for figures in zip(*per_rank, strict=True)]


def test_a_healthy_pod_held_up_in_some_rounds_is_not_slow() -> None:
    """The loaded run of issue 18 rated a healthy pod 0.59x of its peers from its best window;
    held up in two rounds of five (0.59x, 0.3x), it is rated by the other three."""
    rounds = rounds_of(
        [59.0, 100.0, 30.0, 98.0, 101.0], [100.0] * 5, [100.0, 99.0, 100.0, 100.0, 100.0]
    )
    verdict = perf.judge([98.0, 100.0, 100.0], [900.0] * 3, 0, 0.6, 0.25, rounds)
    assert not verdict.slow, verdict.text
    assert "second best of 5 rounds: 0.59 1.01 0.30 0.98 1.01" in verdict.text
    # without the rounds the same pod's median figure is judged as before
    assert perf.judge([59.0, 100.0, 100.0], [900.0] * 3, 0, 0.6).slow


def test_a_slow_pod_is_slow_in_every_round_even_when_its_peers_are_held_up_in_one() -> None:
    rounds = rounds_of([20.0, 22.0, 21.0, 20.0, 19.0], [100.0, 10.0, 100.0, 98.0, 100.0],
                       [100.0, 12.0, 99.0, 100.0, 100.0])  # fmt: skip
    verdict = perf.judge([20.0, 99.0, 99.0], [900.0] * 3, 0, 0.6, 0.25, rounds)
    assert verdict.slow and verdict.text.startswith("slow (below 0.6x of peers)"), verdict.text
    # and its peers are not slow for the round they were held up in
    for rank in (1, 2):
        assert not perf.judge([20.0, 99.0, 99.0], [900.0] * 3, rank, 0.6, 0.25, rounds).slow


def test_a_healthy_pod_held_at_0_59x_in_most_rounds_is_not_slow() -> None:
    """Run 47 of the loaded e2e: a healthy pod at 0.66 0.66 0.58 0.59 0.57 of its peers for the
    whole check (median 0.59x: slow by the median rule); a slow pod is below in every round."""
    ratios = [0.66, 0.66, 0.58, 0.59, 0.57]
    assert perf.rating(ratios) == 0.66
    assert perf.rating([0.08, 0.11, 0.08, 0.07, 0.10]) == 0.10
    assert perf.rating([0.08, 0.95, 0.08, 0.07, 0.10]) == 0.10  # one lucky round: still slow
    assert perf.rating([0.4]) == 0.4


def test_round_ratios_table() -> None:
    rounds = [[50.0, 100.0, 100.0], [100.0, 100.0, 50.0], [0.0, 0.0, 0.0]]
    assert perf.round_ratios(rounds, 0) == [0.5, pytest.approx(4 / 3), 1.0]  # peers at 0: 1.0
    assert perf.round_ratios(rounds, 2) == [pytest.approx(4 / 3), 0.5, 1.0]


def test_compute_rounds_start_together_after_a_barrier() -> None:
    calls: list[str] = []

    class FakeTorch:
        @staticmethod
        def randn(*shape: int, device: object = None) -> tuple[int, ...]:
            return shape

        @staticmethod
        def mm(a: object, b: object) -> None:
            calls.append("mm")

    dist = types.SimpleNamespace(barrier=lambda: calls.append("barrier"))
    figures = perf._compute_rounds(FakeTorch, dist, 64, 3, 0.005, None)
    assert len(figures) == 3 and all(f > 0 for f in figures)
    assert calls.count("barrier") == 3 and calls[0] == "barrier"
    # each round's products come after its barrier
    starts = [i for i, c in enumerate(calls) if c == "barrier"]
    assert all(calls[i + 1] == "mm" for i in starts)
