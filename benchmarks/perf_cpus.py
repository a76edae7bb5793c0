"""allreduce_perf on one host: each compute round the best of a window on each CPU
(``perf.round_cpus``), against the rounds left wherever the scheduler put them and against one
CPU per round (the first fix, 6be9e79), side by side, alternated, in one run.

Usage: python benchmarks/perf_cpus.py [--runs 20] [--pods 2]

Each run starts ``--pods`` real check children (``python -m aegis.checks.collective perf``, a
gloo group on loopback) as two healthy nodes sharing this machine would, and records every
pod's compute rating (the second best of its five rounds' ratios to its peers' median) and
whether any pod was named slow. The CPUs of a virtual machine need not compute alike, and
nothing in the guest shows it (no run delay, no steal time): the low rating of a healthy pod
is the figure to compare, and how far above 1 the high one is (one CPU per round multiplies a
rating by the gap between the CPUs, which would hide a pod that is slow by less than the gap).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys

from aegis.spawn.ports import free_port

RUN = "from aegis.checks import collective; import sys; sys.exit(collective.main(sys.argv[1:]))"
MODES = {
    "each window on a CPU": RUN,
    "one CPU per round": "from aegis.checks import perf; "
    "perf.round_cpus = lambda cpus, rank, i: [cpus[(rank + i) % len(cpus)]]; " + RUN,
    "left in place": "from aegis.checks import perf; perf.round_cpus = lambda *a: [None]; " + RUN,
}
RATING = re.compile(r"second best of 5 rounds: ([0-9. ]+)\)")


def one_run(pods: int, code: str) -> tuple[list[float], bool]:
    """Every pod's rating in one check round, and whether any pod was named slow."""
    port = free_port()
    group = ["--world-size", str(pods), "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, "perf", "--rank", str(rank), *group],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(pods)
    ]
    ratings, slow = [], False
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        answer = json.loads(out.strip().splitlines()[-1])
        found = RATING.search(answer["result"])
        if found is None:
            raise SystemExit(f"no rounds in {answer['result']!r}")
        ratios = sorted(float(v) for v in found.group(1).split())
        ratings.append(ratios[-2])
        slow = slow or bool(answer["slow"])
    return ratings, slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--pods", type=int, default=2)
    args = parser.parse_args()
    lows: dict[str, list[float]] = {name: [] for name in MODES}
    highs: dict[str, list[float]] = {name: [] for name in MODES}
    slows = dict.fromkeys(MODES, 0)
    for _ in range(args.runs):
        for name, code in MODES.items():
            ratings, slow = one_run(args.pods, code)
            lows[name].append(min(ratings))
            highs[name].append(max(ratings))
            slows[name] += slow
    print(f"# {datetime.date.today()} {platform.node()} {os.cpu_count()} CPUs, "
          f"{args.pods} pods, {args.runs} runs each, alternated")  # fmt: skip
    for name in MODES:
        low, high = sorted(lows[name]), sorted(highs[name])
        print(f"{name:21s} lowest rating: min {low[0]:.2f} median {statistics.median(low):.2f}"
              f" | highest: median {statistics.median(high):.2f} max {high[-1]:.2f}"
              f" | runs with a pod named slow: {slows[name]}/{args.runs}")  # fmt: skip


if __name__ == "__main__":
    main()
