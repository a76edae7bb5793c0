"""``aegis verify``: exhaustive model check of the production state machine."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from aegis.cli import render
from aegis.core.model import JobSpec
from aegis.tools.verify import checker


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)


def verify(
    workers: Annotated[int, typer.Option(min=1, max=8, help="Pods in the model job.")] = 3,
    max_retry: Annotated[int, typer.Option(min=0, max=6, help="The job's fault budget.")] = 2,
    faults: Annotated[
        int | None,
        typer.Option(min=0, help="Disruptive events per run (default: max_retry + 4)."),
    ] = None,
    max_states: Annotated[int, typer.Option(min=1, help="Stop past this many states.")] = 5_000_000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> int:
    """Explore every reachable state of `step`; exit 0 when every invariant holds, 1 otherwise."""
    spec = JobSpec(job="verify", namespace="default", worker_num=workers, max_retry=max_retry)
    default = checker.default_bounds(spec)
    fault_bound = faults if faults is not None else default.faults
    result = checker.check(spec, checker.Bounds(faults=fault_bound, max_states=max_states))
    if as_json:
        print(json.dumps(to_json(result)))
    else:
        print_report(result)
    raise typer.Exit(0 if result.ok else 1)


def to_json(result: checker.VerifyResult) -> dict[str, object]:
    violation = result.violation
    return {
        "ok": result.ok,
        "workers": result.spec.worker_num,
        "max_retry": result.spec.max_retry,
        "bounds": {"faults": result.bounds.faults, "max_states": result.bounds.max_states},
        "complete": result.complete,
        "distinct_states": result.states,
        "transitions": result.transitions,
        "depth": result.depth,
        "max_seq": result.max_seq,
        "terminal_states": result.terminal_states,
        "wall_s": round(result.wall_s, 3),
        "states_per_s": round(result.states_per_s, 1),
        "invariants": {
            name: _VERDICT_WORDS[held].strip() for name, held in result.verdicts.items()
        },
        "violation": None
        if violation is None
        else {
            "invariant": violation.invariant,
            "message": violation.message,
            "trace": [render.describe_event(e) for e in violation.trace],
        },
    }


_VERDICT_WORDS = {True: "ok      ", False: "VIOLATED", None: "unproven"}  # None: not checked


def print_report(result: checker.VerifyResult) -> None:
    out = render.make_console()
    spec, bounds = result.spec, result.bounds
    out.print(
        f"aegis verify: {spec.worker_num} workers, max_retry {spec.max_retry}; bounds: "
        f"{bounds.faults} disruptive events per run, {bounds.max_states:,} states at most"
    )
    out.print(
        f"  distinct states {result.states:,} (pods up to symmetry, seq relative), "
        f"transitions {result.transitions:,}, depth {result.depth}, max seq {result.max_seq}, "
        f"terminal states {result.terminal_states:,}"
    )
    out.print(f"  wall time {result.wall_s:.2f} s ({result.states_per_s:,.0f} states/s)")
    if not result.complete:
        out.print("  INCOMPLETE: the state bound was reached before the space was exhausted")
    for name, held in result.verdicts.items():
        out.print(f"  {_VERDICT_WORDS[held]} {name}")
    violation = result.violation
    if violation is not None:
        out.print(f"\nviolation of {violation.invariant}: {violation.message}")
        out.print(f"shortest trace ({len(violation.trace)} events):")
        for number, event in enumerate(violation.trace, start=1):
            out.print(f"  {number:3d}. {render.describe_event(event)}")
        out.print(f"  -> {render.summary_line(spec, violation.status)}")
    else:
        out.print("all invariants hold" if result.ok else "verification incomplete")
