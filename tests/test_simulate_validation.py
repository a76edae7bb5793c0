"""Validation against published theory (Young 1974, Daly 2006) and the field (Llama 3)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from aegis.tools.simulate import engine, search, theory
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc

COST_S = 300.0  # Daly's worked cases: a 5-minute checkpoint
# MTBF -> Daly's published optimum (minutes), FGCS 22 (2006)
DALY_CASES = [(24 * 3600.0, 117.0), (6 * 3600.0, 57.0), (15 * 60.0, 9.1)]


def _exponential(mtbf_s: float, days: float, cost_s: float = COST_S) -> engine.SimSpec:
    return engine.SimSpec(
        gpus=8,
        days=days,
        trace=flt.TraceKind.EXPONENTIAL,
        mtbf_s=mtbf_s,
        ckpt_cost_s=cost_s,
        policy=rc.Policy.RESTART_FROM_CHECKPOINT,
    )


@pytest.mark.parametrize(("mtbf_s", "published_min"), DALY_CASES)
def test_model_optimum_matches_daly_within_5_percent_when_faults_are_exponential(
    mtbf_s: float, published_min: float
) -> None:
    best = theory.best_interval(COST_S, mtbf_s)
    assert math.isclose(best, theory.daly_interval(COST_S, mtbf_s), rel_tol=0.05)
    assert math.isclose(best / 60.0, published_min, rel_tol=0.05)


@pytest.mark.parametrize(
    ("mtbf_s", "days"), [(24 * 3600.0, 3000.0), (6 * 3600.0, 1000.0), (15 * 60.0, 120.0)]
)
def test_simulated_optimum_matches_daly_within_5_percent_when_faults_are_exponential(
    mtbf_s: float, days: float
) -> None:
    found = search.simulated_best_interval(_exponential(mtbf_s, days), seeds=(1, 2, 3))
    assert math.isclose(found.interval_s, theory.daly_interval(COST_S, mtbf_s), rel_tol=0.05)


def test_simulated_ratio_matches_the_expected_value_model_when_faults_are_exponential() -> None:
    spec = _exponential(6 * 3600.0, 1000.0)
    restart = rc.mean_interruption_s(spec.policy, spec.settings)
    for factor in (0.5, 1.0, 2.0):
        interval = theory.daly_interval(COST_S, 6 * 3600.0) * factor
        result = engine.run(replace(spec, ckpt_interval_s=interval))
        model = theory.expected_ratio(interval, COST_S, 6 * 3600.0, restart)
        assert math.isclose(result.ratio, model, rel_tol=0.01)


def test_young_holds_in_its_range_when_cost_is_small_against_mtbf() -> None:
    day = 24 * 3600.0
    assert math.isclose(
        theory.best_interval(COST_S, day), theory.young_interval(COST_S, day), rel_tol=0.05
    )
    assert math.isclose(
        theory.best_interval(10.0, day), theory.young_interval(10.0, day), rel_tol=0.01
    )
    # Outside its range (cost a third of the MTBF) Young's first order overshoots by far.
    assert theory.young_interval(COST_S, 900.0) > 1.3 * theory.best_interval(COST_S, 900.0)


def test_simulated_optimum_matches_young_when_cost_is_small_against_mtbf() -> None:
    day, cost = 24 * 3600.0, 60.0  # cost / MTBF = 0.0007: Young's first order holds
    found = search.simulated_best_interval(_exponential(day, 3000.0, cost), seeds=(1, 2, 3))
    assert math.isclose(found.interval_s, theory.young_interval(cost, day), rel_tol=0.05)


def test_best_interval_does_not_depend_on_restart_time() -> None:
    assert math.isclose(
        theory.best_interval(30.0, 3600.0, 0.0),
        theory.best_interval(30.0, 3600.0, 900.0),
        rel_tol=1e-4,
    )


def test_restart_from_checkpoint_lands_near_llama3s_90_percent_when_on_their_setting() -> None:
    spec = engine.SimSpec(policy=rc.Policy.RESTART_FROM_CHECKPOINT, ckpt_cost_s=10.0)
    mtbf = spec.trace_spec().job_mtbf_s()
    spec = replace(spec, ckpt_interval_s=theory.best_interval(spec.ckpt_cost_s, mtbf))
    ratios = [engine.run(replace(spec, seed=seed)).ratio for seed in range(3)]
    assert all(0.86 <= ratio <= 0.93 for ratio in ratios)
