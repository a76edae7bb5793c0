"""Hang detection under default flags, and the culprit named (issue 18).

Usage: python benchmarks/hang_detection.py [--trials 10] [--ranks 4] [--seed 1]

Each trial: ``aegis run --isolate-nodes`` (the emulated cluster) with **no** ``--hang-timeout-s``
runs ``tests/bin/plain_ddp.py`` (plain DDP, gloo, no aegis import; ``--quiet``: only rank 0
prints) and a random rank sleeps forever at a random step while the others wait for it in DDP's
backward. Measured from the events and logs the run leaves:
- detection: from the stuck rank's last step (its ``hanging at step`` line) to the master's
  ``HangJudged`` record (every pod's watchdog fired, their stacks judged);
- the goal of the issue beside it: max(10 x the p99 step time of rank 0's steps, 30 s) + 1 s;
- whether the judged pod is the stuck rank's, and that no other node was blacklisted.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "bin" / "plain_ddp.py"


def _stamp(line: str) -> float:
    return datetime.datetime.fromisoformat(line.split(maxsplit=1)[0]).timestamp()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def trial(work: Path, rank: int, step: int, ranks: int) -> dict[str, Any]:
    logs, ckpt = work / "logs", work / "ckpt"
    command = [sys.executable, str(SCRIPT), "--steps", str(step + 60), "--ckpt-every", "50",
               "--ckpt-dir", str(ckpt), "--quiet", "--step-time-s", "0.02",
               "--hang-at-step", str(step), "--hang-rank", str(rank)]  # fmt: skip
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--isolate-nodes",
            "--nodes", str(ranks), "--spare-nodes", "1", "--job", "hb", "--view", "plain",
            "--log-dir", str(logs), "--status-file", str(work / "status.json"),
            "--", *command]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    status = json.loads((work / "status.json").read_text())["status"]
    events = [json.loads(x) for x in (logs / "events.jsonl").read_text().splitlines()]
    judged = [e for e in events if e.get("type") == "HangJudged"]
    pods = {p: (logs / "pods" / f"hb-{p}.log").read_text().splitlines() for p in range(ranks)}
    stuck = [x for x in pods[rank] if "hanging at step" in x]
    steps0 = [_stamp(x) for x in pods[0] if " rank=0 step " in x]
    before = [t for t in steps0 if stuck and t < _stamp(stuck[0])]
    intervals = [b - a for a, b in itertools.pairwise(before)]
    result: dict[str, Any] = {"rc": done.returncode, "rank": rank, "step": step,
                              "phase": status["phase"]}  # fmt: skip
    if judged and stuck and intervals:
        tail = p99(intervals)
        result.update(
            detection_s=judged[0]["ts"] - _stamp(stuck[0]),
            goal_s=max(10 * tail, 30.0) + 1.0,
            p99_step_s=tail,
            named=judged[0]["pod"] == f"hb-{rank}" and judged[0]["blame"],
            others_blacklisted=[e["node"] for e in status["error_nodes"]
                                if e["node"] != f"node-{rank}"],
        )  # fmt: skip
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    now = datetime.datetime.now(datetime.UTC)
    print(f"# hang detection, {now:%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores, {args.ranks} ranks, default flags")  # fmt: skip
    results = []
    for number in range(args.trials):
        rank, step = rng.randrange(args.ranks), rng.randrange(60, 140)
        with tempfile.TemporaryDirectory(prefix="aegis-hang-") as tmp:
            result = trial(Path(tmp), rank, step, args.ranks)
        results.append(result)
        print(f"trial {number + 1}: {json.dumps(result, sort_keys=True)}", flush=True)
    measured = [r for r in results if "detection_s" in r]
    named = sum(bool(r["named"]) for r in measured)
    print(
        f"named the stuck rank in {named} of {len(results)} trials; "
        f"other nodes blacklisted: {sum(len(r['others_blacklisted']) for r in measured)}; "
        f"succeeded: {sum(r['phase'] == 'Succeed' for r in results)}"
    )
    if measured:
        detect = [float(r["detection_s"]) for r in measured]
        goal = [float(r["goal_s"]) for r in measured]
        ratio = [d / g for d, g in zip(detect, goal, strict=True)]
        print(f"detection median {statistics.median(detect):.2f} s (max {max(detect):.2f} s), "
              f"goal median {statistics.median(goal):.2f} s; detection/goal median "
              f"{statistics.median(ratio):.3f} max {max(ratio):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
