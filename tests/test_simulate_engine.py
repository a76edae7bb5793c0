"""The simulation's event engine: ordering, determinism, accounting, the fault budget."""

from __future__ import annotations

import math
from dataclasses import replace

from aegis.tools.simulate import engine
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc
from aegis.tools.simulate.events import EventKind, EventQueue, SimEvent

SMALL = engine.SimSpec(
    gpus=64,
    days=10.0,
    trace=flt.TraceKind.EXPONENTIAL,
    mtbf_s=4 * 3600.0,
    ckpt_interval_s=1800.0,
    ckpt_cost_s=30.0,
)


def test_event_queue_pops_in_time_order_when_pushed_out_of_order() -> None:
    queue = EventQueue()
    for t in (5.0, 1.0, 3.0, 2.0, 4.0):
        queue.push(SimEvent(t, EventKind.FAULT))
    assert [queue.pop().time_s for _ in range(5)] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(queue) == 0


def test_event_queue_keeps_push_order_when_times_tie() -> None:
    queue = EventQueue()
    kinds = [EventKind.SAVE_DONE, EventKind.FAULT, EventKind.COMMIT, EventKind.END]
    for kind in kinds:
        queue.push(SimEvent(7.0, kind))
    assert [queue.pop().kind for _ in kinds] == kinds


def test_run_is_deterministic_when_the_seed_is_the_same() -> None:
    first, second = engine.run(SMALL), engine.run(SMALL)
    assert first == second
    other = engine.run(replace(SMALL, seed=1))
    assert other.by_cause != first.by_cause or other.useful_s != first.useful_s


def test_run_accounts_for_every_second_of_wall_time() -> None:
    for policy in rc.Policy:
        result = engine.run(replace(SMALL, policy=policy))
        total = result.useful_s + sum(result.lost_s.values())
        assert math.isclose(total, SMALL.horizon_s, rel_tol=1e-9)
        assert all(lost >= 0 for lost in result.lost_s.values())
        assert 0.0 < result.ratio < 1.0


def test_run_loses_only_checkpoint_time_when_no_fault_arrives() -> None:
    spec = replace(SMALL, mtbf_s=1e15, ckpt_interval_s=900.0, days=1.0)
    result = engine.run(spec)
    assert result.faults == 0
    assert result.lost_s["detection"] == result.lost_s["recovery"] == result.lost_s["rollback"] == 0
    saves = math.floor(spec.horizon_s / (900.0 + 30.0))
    assert math.isclose(result.lost_s["checkpoint"], saves * 30.0, abs_tol=30.0)


def test_aegis_detects_faster_than_nccl_timeout_when_the_trace_is_the_same() -> None:
    aegis = engine.run(SMALL)
    baseline = engine.run(replace(SMALL, policy=rc.Policy.RESTART_FROM_CHECKPOINT))
    assert aegis.faults == baseline.faults > 0
    assert aegis.by_cause == baseline.by_cause
    assert aegis.lost_s["detection"] < baseline.lost_s["detection"]
    assert baseline.by_level == {"job relaunch": baseline.faults}
    assert baseline.core_steps == 0


def test_aegis_feeds_the_core_every_pods_answers_when_faults_happen() -> None:
    result = engine.run(SMALL)
    pods = SMALL.nodes
    # Start (ACK + bootcheck), end (Finish), and at least one round of answers per fault.
    assert result.core_steps >= 3 * pods + result.faults * (pods + 1)
    counted = sum(n for level, n in result.by_level.items() if level != "EVICT_SLOW")
    assert counted == result.faults


def test_job_fails_every_max_retry_plus_one_faults_when_the_budget_is_small() -> None:
    spec = replace(SMALL, mtbf_s=3600.0, days=2.0, max_retry=3, seed=4)
    result = engine.run(spec)
    assert result.faults >= 8
    assert result.failures == result.faults // (spec.max_retry + 1)
    assert result.first_failure_s is not None
    assert result.first_failure_s > 0


def test_job_never_fails_when_the_budget_is_large() -> None:
    result = engine.run(SMALL)
    assert result.failures == 0
    assert result.first_failure_s is None
