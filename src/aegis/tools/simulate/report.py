"""A simulation's result as a JSON-ready dict and as text lines (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass

from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc
from aegis.tools.simulate import theory
from aegis.tools.simulate.engine import SimResult, SimSpec

LLAMA3_REPORTED = ">90% effective training time (Llama 3, 16,384 H100, 54 days)"
BYTEROBUST_REPORTED = ">=97% (ByteRobust, 9,600 GPUs, 3 months; the best published)"
LOST_CAUSES = ("detection", "recovery", "rollback", "checkpoint")


@dataclass(frozen=True, slots=True)
class IntervalChoice:
    interval_s: float
    auto: bool
    young_s: float
    daly_s: float


def choose_interval(spec: SimSpec, requested_s: float | None) -> IntervalChoice:
    """``requested_s`` None: the interval that maximises the expected-value model (auto)."""
    mtbf = spec.trace_spec().job_mtbf_s()
    cost = spec.ckpt_cost_s
    young, daly = theory.young_interval(cost, mtbf), theory.daly_interval(cost, mtbf)
    if requested_s is None:
        return IntervalChoice(theory.best_interval(cost, mtbf), True, young, daly)
    return IntervalChoice(requested_s, False, young, daly)


def model_ratio(spec: SimSpec) -> float:
    """What the expected-value model (Daly's, with this policy's mean interruption) predicts."""
    mtbf = spec.trace_spec().job_mtbf_s()
    restart = rc.mean_interruption_s(spec.policy, spec.settings)
    return theory.expected_ratio(spec.ckpt_interval_s, spec.ckpt_cost_s, mtbf, restart)


def to_dict(result: SimResult, choice: IntervalChoice, runtime_s: float) -> dict[str, object]:
    spec = result.spec
    return {
        "policy": spec.policy.value,
        "gpus": spec.gpus,
        "gpus_per_node": spec.gpus_per_node,
        "nodes": spec.nodes,
        "days": spec.days,
        "trace": spec.trace.value,
        "job_mtbf_h": spec.trace_spec().job_mtbf_s() / 3600.0,
        "seed": spec.seed,
        "max_retry": spec.max_retry,
        "ckpt_interval_min": choice.interval_s / 60.0,
        "ckpt_interval_auto": choice.auto,
        "young_interval_min": choice.young_s / 60.0,
        "daly_interval_min": choice.daly_s / 60.0,
        "ckpt_cost_s": spec.ckpt_cost_s,
        "effective_training_time_ratio": result.ratio,
        "model_ratio": model_ratio(spec),
        "wall_h": spec.horizon_s / 3600.0,
        "useful_h": result.useful_s / 3600.0,
        "lost_h": {cause: result.lost_s[cause] / 3600.0 for cause in LOST_CAUSES},
        "faults": result.faults,
        "interruptions_by_recovery_level": dict(sorted(result.by_level.items())),
        "faults_by_cause": dict(sorted(result.by_cause.items(), key=lambda kv: -kv[1])),
        "job_failed": result.failures > 0,
        "failures": result.failures,
        "first_failure_day": None
        if result.first_failure_s is None
        else result.first_failure_s / flt.DAY_S,
        "core_steps": result.core_steps,
        "runtime_s": runtime_s,
    }


def text_lines(result: SimResult, choice: IntervalChoice, runtime_s: float) -> list[str]:
    spec = result.spec
    mtbf_h = spec.trace_spec().job_mtbf_s() / 3600.0
    how = "auto: the expected-value model's optimum" if choice.auto else "given"
    lines = [
        f"aegis simulate: {spec.gpus:,} GPUs ({spec.nodes:,} nodes x {spec.gpus_per_node}), "
        f"{spec.days:g} days, trace {spec.trace} (job MTBF {mtbf_h:.2f} h), seed {spec.seed}",
        f"  checkpoint every {choice.interval_s / 60:.1f} min ({how}; Young "
        f"{choice.young_s / 60:.1f}, Daly {choice.daly_s / 60:.1f}), cost {spec.ckpt_cost_s:g} s",
        f"  policy {spec.policy}: effective training time {100 * result.ratio:.2f} % "
        f"(expected-value model: {100 * model_ratio(spec):.2f} %)",
        "  lost time            hours   % of wall",
    ]
    for cause in LOST_CAUSES:
        hours = result.lost_s[cause] / 3600.0
        lines.append(
            f"    {cause:<16} {hours:8.1f}   {100 * result.lost_s[cause] / spec.horizon_s:6.2f}"
        )
    levels = ", ".join(f"{name} {n}" for name, n in sorted(result.by_level.items()))
    lines.append(f"  faults {result.faults}; interruptions by recovery level: {levels}")
    if spec.policy is rc.Policy.AEGIS:
        lines.append(_budget_line(result))
        lines.append(f"  real core: {result.core_steps:,} step calls; run took {runtime_s:.1f} s")
    else:
        lines.append(
            f"  run took {runtime_s:.2f} s (no fault budget: every fault relaunches the job)"
        )
    return lines


def _budget_line(result: SimResult) -> str:
    spec = result.spec
    if result.failures == 0:
        return (
            f"  fault budget: max_retry {spec.max_retry:,} never exhausted (a real job with a "
            f"small max_retry would have Failed after max_retry + 1 faults)"
        )
    assert result.first_failure_s is not None
    return (
        f"  fault budget: the real job would have FAILED on day "
        f"{result.first_failure_s / flt.DAY_S:.1f} (max_retry {spec.max_retry} spent); "
        f"simulated as resubmitted, {result.failures} failure(s) in all"
    )


def comparison_lines(aegis: SimResult | None, baseline: SimResult | None) -> list[str]:
    lines = ["  effective training time, side by side:"]
    if baseline is not None:
        lines.append(f"    restart-from-checkpoint  {100 * baseline.ratio:6.2f} %")
    if aegis is not None:
        lines.append(f"    aegis                    {100 * aegis.ratio:6.2f} %")
    lines.append(f"    reported: {LLAMA3_REPORTED}")
    lines.append(f"    reported: {BYTEROBUST_REPORTED}")
    return lines
