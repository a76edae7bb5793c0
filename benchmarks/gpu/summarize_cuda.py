"""Summarise the runs of ``benchmarks/gpu/cuda_recovery.sh``: ``summarize_cuda.py DIR``.

DIR holds one folder a run, each with the ``rank-<R>.jsonl`` records of ``cuda_train.py`` and the
``run.log`` of ``aegis run``. One line a run: the exit code, each incarnation's start (warm or
cold, whether CUDA was initialised before the script touched it, whether the process's parent had
the CUDA driver mapped, the step it resumed from and whether the weights matched the saved ones,
where a DCP load read them), the recovery (the crash to every rank's next step) and the seconds
a save took.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def records(run: Path) -> dict[int, list[dict[str, Any]]]:
    found: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(run.glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        found[rank] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return found


def first(events: list[dict[str, Any]], kind: str, **match: Any) -> dict[str, Any] | None:
    for event in events:
        if event["event"] == kind and all(event.get(k) == v for k, v in match.items()):
            return event
    return None


def summary(run: Path) -> str:
    by_rank = records(run)
    if not by_rank:
        return f"{run.name}: no records"
    everything = [e for events in by_rank.values() for e in events]
    starts = [e for e in everything if e["event"] == "start"]
    crash = next((e for e in everything if e["event"] == "crash"), None)
    parts = [f"{run.name}:"]
    for s in sorted(starts, key=lambda e: (e["incarnation"], e["t"])):
        parts.append(
            f"inc {s['incarnation']} {'warm' if s['warm'] else 'cold'} on {s['name']}"
            f" cuda_before={s['cuda_before']} parent ({s['parent']}) cuda={s['parent_cuda']}"
            f" resumed_from={s['resumed_from']} match={s['match']} source={s['source']};"
        )
    if crash is not None:
        nexts = [first(events, "step", incarnation=1) for events in by_rank.values()]
        if all(n is not None for n in nexts):
            back = max(n["t"] for n in nexts if n is not None) - crash["t"]
            at = crash["step"]
            parts.append(f"recovery {back:.2f} s (crash at step {at} to every rank's next step);")
    saves = [e["seconds"] for e in everything if e["event"] == "save"]
    if saves:
        saves.sort()
        parts.append(f"save median {saves[len(saves) // 2]:.3f} s, max {saves[-1]:.3f} s;")
    ends = [e for e in everything if e["event"] == "end"]
    parts.append(
        f"{len(ends)}/{len(by_rank)} ranks ended, peak GPU memory"
        f" {max((e['peak_bytes'] for e in ends), default=0) / 2**20:.0f} MiB"
    )
    return " ".join(parts)


def main() -> None:
    for run in sorted(p for p in Path(sys.argv[1]).iterdir() if p.is_dir()):
        print(summary(run))


if __name__ == "__main__":
    main()
