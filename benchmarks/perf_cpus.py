"""allreduce_perf on one host: each compute round on another CPU (``perf.round_cpu``) against
the rounds left wherever the scheduler put them, side by side, alternated, in one run.

Usage: python benchmarks/perf_cpus.py [--runs 20] [--pods 2]

Each run starts ``--pods`` real check children (``python -m aegis.checks.collective perf``, a
gloo group on loopback) as two healthy nodes sharing this machine would, and records every
pod's compute rating (the second best of its five rounds' ratios to its peers' median) and
whether any pod was named slow. The CPUs of a virtual machine need not compute alike, and
nothing in the guest shows it (no run delay, no steal time): the low rating of a healthy pod
is the figure to compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys

UNPINNED = "from aegis.checks import perf; perf.round_cpu = lambda *a: None; "
RUN = "from aegis.checks import collective; import sys; sys.exit(collective.main(sys.argv[1:]))"
RATING = re.compile(r"second best of 5 rounds: ([0-9. ]+)\)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(pods: int, pinned: bool) -> tuple[list[float], bool]:
    """Every pod's rating in one check round, and whether any pod was named slow."""
    port = _free_port()
    code = RUN if pinned else UNPINNED + RUN
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
    lows: dict[str, list[float]] = {"pinned": [], "unpinned": []}
    slows = {"pinned": 0, "unpinned": 0}
    for _ in range(args.runs):
        for name in ("unpinned", "pinned"):
            ratings, slow = one_run(args.pods, name == "pinned")
            lows[name].append(min(ratings))
            slows[name] += slow
    print(f"# {datetime.date.today()} {platform.node()} {os.cpu_count()} CPUs, "
          f"{args.pods} pods, {args.runs} runs each, alternated")  # fmt: skip
    for name in ("unpinned", "pinned"):
        low = sorted(lows[name])
        print(f"{name:9s} lowest rating: min {low[0]:.2f} median {statistics.median(low):.2f}"
              f" | runs with a pod named slow: {slows[name]}/{args.runs}")  # fmt: skip


if __name__ == "__main__":
    main()
