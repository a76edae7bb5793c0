"""Benchmark of ``aegis simulate``: runtime at 16,384 GPUs over 54 days, ratios, validations.

Run: .venv/bin/python benchmarks/simulate.py [--seeds N]. Prints Markdown for RESULTS.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from aegis.tools.simulate import engine, search, theory
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc

COST_S = 300.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    spec = engine.SimSpec(ckpt_cost_s=10.0)
    mtbf = spec.trace_spec().job_mtbf_s()
    spec = replace(spec, ckpt_interval_s=theory.best_interval(spec.ckpt_cost_s, mtbf))
    print("### 54 days, 16,384 GPUs (2,048 nodes), llama3 trace, checkpoint cost 10 s, auto")
    print(f"job MTBF {mtbf / 3600:.2f} h; interval {spec.ckpt_interval_s / 60:.1f} min\n")
    print(
        "| policy | seed | faults | ratio | detection h | recovery h | rollback h | ckpt h "
        "| levels | core steps | runtime s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for policy in (rc.Policy.RESTART_FROM_CHECKPOINT, rc.Policy.AEGIS):
        for seed in range(args.seeds):
            started = time.perf_counter()
            result = engine.run(replace(spec, policy=policy, seed=seed))
            took = time.perf_counter() - started
            lost = " | ".join(
                f"{result.lost_s[k] / 3600:.1f}"
                for k in ("detection", "recovery", "rollback", "checkpoint")
            )
            levels = ", ".join(f"{k} {v}" for k, v in sorted(result.by_level.items()))
            print(
                f"| {policy} | {seed} | {result.faults} | {100 * result.ratio:.2f} % | {lost} "
                f"| {levels} | {result.core_steps:,} | {took:.1f} |"
            )
    print("\n### Daly (FGCS 2006) worked cases, checkpoint cost 5 min (minutes)\n")
    print(
        "| MTBF | Daly published | Daly formula | model search | simulated search | Young | "
        "search runtime s |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, mtbf_s, published, days in (
        ("24 h", 86400.0, 117, 3000.0),
        ("6 h", 21600.0, 57, 1000.0),
        ("15 min", 900.0, 9.1, 120.0),
    ):
        sim_spec = engine.SimSpec(
            gpus=8,
            days=days,
            trace=flt.TraceKind.EXPONENTIAL,
            mtbf_s=mtbf_s,
            ckpt_cost_s=COST_S,
            policy=rc.Policy.RESTART_FROM_CHECKPOINT,
        )
        started = time.perf_counter()
        found = search.simulated_best_interval(sim_spec, seeds=(1, 2, 3))
        took = time.perf_counter() - started
        print(
            f"| {label} | {published} | {theory.daly_interval(COST_S, mtbf_s) / 60:.1f} "
            f"| {theory.best_interval(COST_S, mtbf_s) / 60:.1f} | {found.interval_s / 60:.1f} "
            f"| {theory.young_interval(COST_S, mtbf_s) / 60:.1f} | {took:.1f} |"
        )


if __name__ == "__main__":
    main()
