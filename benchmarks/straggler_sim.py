"""How often the straggler score names a healthy pod, and how often it names a late one, on the
simulated job of tests/test_stragglers.py (issue 17: the lateness read at each peer's own pace).

Usage: python benchmarks/straggler_sim.py [--seeds N] [--min-late STEPS]

Two set-ups, each over ``--seeds`` seeds x {3, 4, 8} pods, 90 s of a synchronous job beating once
a second, 5-s windows: a steady pace (40-ms steps, +-15 ms of jitter), and a pace that alternates
between 40-ms and 120-ms steps in spells of 1 to 5 s (a loaded machine). For each: healthy runs
in which someone was named (false), and runs with a pod half a step late from t=30 s in which
that pod was named at the end. Each with today's reading of a peer's end of a step (between
its own samples, at its own pace) and, side by side, the baseline it replaced (the nearest
samples moved to the step at the window's average period). Figures in RESULTS.md.
"""

from __future__ import annotations

import argparse
import bisect
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aegis.core import stragglers
from aegis.master.pace import StragglerWatch
from tests.test_stragglers import (
    PERIOD_S,
    changing_pace,
    settings,
    simulate,
    straggler_from,
)


def at_average_period(
    pooled: Sequence[tuple[int, float, str]],
    own: Mapping[str, object],
    pod: str,
    step: int,
    period: float,
    neighbours: int,
) -> float | None:
    """The baseline: the nearest sample of each peer on either side, moved to ``step`` at the
    window's average period."""
    i = bisect.bisect_left(pooled, (step, -math.inf, ""))
    found: list[float] = []
    for indexes in (range(i - 1, -1, -1), range(i, len(pooled))):
        seen: set[str] = set()
        for j in indexes:
            k, end, other = pooled[j]
            if other == pod or other in seen:
                continue
            seen.add(other)
            found.append(end + (step - k) * period)
            if len(seen) >= max(neighbours // 2, 1):
                break
    return statistics.median(found) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--min-late", type=float, default=None, help="default: the core's")
    args = parser.parse_args()
    seeds, knobs = args.seeds, {} if args.min_late is None else {"min_late": args.min_late}
    today = stragglers._reference
    for reading, reference in (
        ("own pace", today),
        ("average period (baseline)", at_average_period),
    ):
        stragglers._reference = reference
        print(f"peers read at their {reading}:")
        run(seeds, knobs)
    stragglers._reference = today


def run(seeds: int, knobs: dict[str, float]) -> None:
    for name, jitter, pace in (
        ("steady pace", 0.015, lambda seed: lambda now: PERIOD_S),
        ("changing pace", 0.008, changing_pace),
    ):
        false = named = runs = 0
        for pods in (3, 4, 8):
            for seed in range(seeds):
                watch = StragglerWatch(settings(**knobs))
                healthy = simulate(watch, pods, 0.0, 90.0, seed=seed, jitter_s=jitter,
                                   period_at=pace(100 + seed))  # fmt: skip
                false += set(healthy) != {None}
                watch = StragglerWatch(settings(**knobs))
                late = simulate(watch, pods, 0.0, 90.0, straggler_from("j-1", 30.0, 0.5 * PERIOD_S),
                                seed=seed, jitter_s=jitter, period_at=pace(100 + seed))  # fmt: skip
                named += late[-1] is not None and late[-1].pod == "j-1"
                runs += 1
        print(f"  {name}: false stragglers {false}/{runs}, a pod half a step late named "
              f"{named}/{runs}")  # fmt: skip


if __name__ == "__main__":
    main()
