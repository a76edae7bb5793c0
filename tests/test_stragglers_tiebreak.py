"""The straggler score as allreduce_perf's tie-breaker (checks/perf.py, pure): when the figures
cannot tell the pods apart, the pod with the highest straggler score of the training is named;
when they can, they decide."""

from __future__ import annotations

import pytest

from aegis.agent.order_policy import own_score
from aegis.checks import base, group, perf
from aegis.core.recovery import CheckType
from aegis.master.round_orders import scores_env
from aegis.wire import messages as m


def test_ratings_within_noise_name_the_highest_straggler_score() -> None:
    tie = perf.tie_break([1.02, 0.97, 1.0, 0.99], [0.0, 0.01, 0.48, -0.02], 0.6)
    assert tie is not None and tie.rank == 2
    assert "0.48 steps behind its peers" in tie.text and "0.97-1.02" in tie.text


@pytest.mark.parametrize(
    ("rated", "scores", "why"),
    [
        ([1.0, 0.3, 1.0], [0.0, 0.0, 0.5], "a rank below the factor: the figures decide"),
        ([1.0, 1.0, 1.0], [0.05, 0.0, 0.02], "no score reaches the minimum"),
        ([1.0, 1.0, 1.0], [0.5, 0.0, 0.5], "two ranks share the highest score"),
        ([0.65, 1.0, 1.0], [0.0, 0.0, 0.5], "the scorer rates well above the lowest rank"),
        ([1.0], [0.5], "one rank: nothing to break"),
    ],
)
def test_no_tie_break(rated: list[float], scores: list[float], why: str) -> None:
    assert perf.tie_break(rated, scores, 0.6) is None, why


def test_scores_must_cover_every_rank() -> None:
    with pytest.raises(ValueError, match="2 straggler scores for 3 ranks"):
        perf.tie_break([1.0, 1.0, 1.0], [0.0, 0.5], 0.6)


def test_judge_names_only_the_straggler_and_only_when_the_figures_cannot() -> None:
    compute, pair = [100.0, 98.0, 101.0, 99.0], [900.0] * 4
    scores = [0.0, 0.0, 0.45, 0.01]
    verdicts = [perf.judge(compute, pair, r, 0.6, scores=scores) for r in range(4)]
    assert [v.slow for v in verdicts] == [False, False, True, False]
    named = verdicts[2].text
    assert named.startswith("slow (named by its straggler score (0.45 steps"), named
    # without scores, or with a pod the figures name slow, the scores change nothing
    assert not any(perf.judge(compute, pair, r, 0.6).slow for r in range(4))
    slow = [100.0, 30.0, 101.0, 99.0]
    assert [perf.judge(slow, pair, r, 0.6, scores=scores).slow for r in range(4)] == [
        False, True, False, False,
    ]  # fmt: skip
    bad_link = [900.0, 900.0, 900.0, 100.0]
    assert not any(perf.judge(compute, bad_link, r, 0.6, scores=scores).slow for r in (0, 1, 2))


def test_ratings_follow_the_rounds_as_judge_rates() -> None:
    rounds = [[100.0, 50.0, 100.0], [100.0, 52.0, 100.0], [100.0, 100.0, 100.0]]
    rated = perf.ratings([100.0, 52.0, 100.0], rounds)
    assert rated == [pytest.approx(perf.rating(perf.round_ratios(rounds, r))) for r in range(3)]
    assert perf.ratings([100.0, 50.0]) == [2.0, 0.5]
    assert perf.ratings([7.0]) == [1.0]


def _rows(scores: list[float]) -> list[list[float]]:
    """Every rank's gathered row of allreduce_perf: best pair MB/s, score, GFLOP/s per round."""
    return [[500.0, score, 10.0, 10.1, 9.9, 10.0, 10.05] for score in scores]


def test_the_round_verdict_breaks_a_tie_with_the_gathered_scores() -> None:
    verdicts = [perf.round_verdict(_rows([0.0, 0.02, 0.5]), r, 0.6, 0.25) for r in range(3)]
    assert [v["slow"] for v in verdicts] == [False, False, True]
    assert verdicts[2]["straggler_scores"] == [0.0, 0.02, 0.5]
    assert "steps behind its peers" in verdicts[2]["result"]
    unscored = [perf.round_verdict(_rows([0.0, 0.0, 0.0]), r, 0.6, 0.25) for r in range(3)]
    assert not any(v["slow"] for v in unscored)  # no scores: the figures alone, all alike


def test_the_pods_own_score_travels_from_the_order_to_the_check() -> None:
    env = {m.STRAGGLER_SCORES_ENV: "job-0=0.010,job-1=0.480,job-2=-0.020"}
    assert own_score(env, "job-1") == pytest.approx(0.48)
    assert own_score(env, "job-2") == 0.0  # below nothing: no score
    assert own_score(env, "job-9") == 0.0 and own_score({}, "job-1") == 0.0
    assert own_score({m.STRAGGLER_SCORES_ENV: "job-1=nan,job-0=x"}, "job-1") == 0.0
    assert own_score({m.STRAGGLER_SCORES_ENV: "job-0=x"}, "job-0") == 0.0
    settings = base.CheckSettings(
        group=base.GroupInfo(rank=1, world_size=3, master_addr="127.0.0.1", master_port=1),
        perf=base.PerfSettings(straggler_score=own_score(env, "job-1")),
    )
    args = group.collective_args([CheckType.ALLREDUCE_PERF], settings)
    assert args[args.index("--straggler-score") + 1] == "0.48"
    assert scores_env({"job-1": 0.48, "job-0": 0.01}) == "job-0=0.010,job-1=0.480"
