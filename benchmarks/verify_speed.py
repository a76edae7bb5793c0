"""Speed of ``aegis verify``: states per second and wall time, side by side in one run.

Usage: python benchmarks/verify_speed.py [--max-workers 4]

The baseline printed beside each run is the raw cost of the production ``step`` on the same
machine in the same process (steps per second over a fixed fault-free job), so the ratio
"checker transitions/s : raw steps/s" says how much the exploration itself costs on top of
``step``, whatever the machine's speed.
"""

from __future__ import annotations

import argparse
import platform
import time

from aegis.core import events as ev
from aegis.core import machine
from aegis.core.model import JobSpec, initial_status, pod_names
from aegis.core.recovery import Classification
from aegis.tools.verify import checker


def raw_steps_per_s(rounds: int = 300) -> float:
    spec = JobSpec("bench", "default", 8, 2)
    calls = 0
    started = time.perf_counter()
    for _ in range(rounds):
        status = initial_status(spec)
        for pod in pod_names(spec):
            status, _ = machine.step(spec, status, ev.PodAcked(pod), 0.0)
            calls += 1
        for pod in pod_names(spec):
            event = ev.ChecksReported(pod, status.phase, status.seq, Classification.HEALTHY)
            status, _ = machine.step(spec, status, event, 0.0)
            calls += 1
        for pod in pod_names(spec):
            status, _ = machine.step(
                spec, status, ev.PodFinished(pod, status.phase, status.seq, 0), 0.0
            )
            calls += 1
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--max-retry", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {platform.machine()} python {platform.python_version()}")
    baseline = raw_steps_per_s()
    print(f"baseline: raw step() calls/s = {baseline:,.0f}")
    for workers in range(1, args.max_workers + 1):
        spec = JobSpec("verify", "default", workers, args.max_retry)
        result = checker.check(spec)
        tps = result.transitions / result.wall_s
        print(
            f"workers={workers} max_retry={args.max_retry} faults={result.bounds.faults}: "
            f"{result.states:,} states, {result.transitions:,} transitions, depth {result.depth}, "
            f"{result.wall_s:.2f} s, {result.states_per_s:,.0f} states/s, "
            f"{tps:,.0f} transitions/s = {tps / baseline:.2f}x raw step rate, ok={result.ok}"
        )


if __name__ == "__main__":
    main()
