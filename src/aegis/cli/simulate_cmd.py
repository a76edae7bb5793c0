"""``aegis simulate``: effective training time at scale, with Aegis's real state machine inside."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from aegis.tools.simulate import engine, report
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc
from aegis.tools.simulate import settings as sim_settings


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)


def simulate(  # noqa: PLR0913 (a typer command: one parameter per option)
    gpus: Annotated[int, typer.Option(min=1, help="GPUs in the job.")] = 16_384,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node (one pod each).")] = 8,
    days: Annotated[float, typer.Option(min=0.001, help="Wall time simulated, in days.")] = 54.0,
    trace: Annotated[
        flt.TraceKind,
        typer.Option(help="llama3: Llama 3's 419 faults/54 days/2,048 nodes, scaled by nodes."),
    ] = flt.TraceKind.LLAMA3,
    mtbf_h: Annotated[
        float | None, typer.Option(min=0.0001, help="Job MTBF in hours (exponential trace).")
    ] = None,
    ckpt_interval: Annotated[
        str,
        typer.Option(
            help="Minutes of training between checkpoints, or 'auto': the interval that "
            "maximises Daly's expected-value model (his higher-order optimum)."
        ),
    ] = "auto",
    ckpt_cost_s: Annotated[
        float, typer.Option(min=0.0, help="Seconds training pauses for each checkpoint save.")
    ] = 10.0,
    policy: Annotated[rc.Policy, typer.Option(help="Who recovers from faults.")] = rc.Policy.AEGIS,
    seed: Annotated[int, typer.Option(help="Seed of the fault trace (same seed, same run).")] = 0,
    max_retry: Annotated[
        int,
        typer.Option(
            min=0,
            help="The job's fault budget in the real core. Large by default: over 54 days at "
            "16k GPUs hundreds of faults arrive and any small budget would end the job; a "
            "Failed job is reported, then simulated as resubmitted.",
        ),
    ] = 10_000,
    settings_file: Annotated[
        Path | None,
        typer.Option("--settings", help="Durations (TOML or JSON); see examples/simulate/."),
    ] = None,
    compare: Annotated[
        bool, typer.Option(help="Also run the other policy and print both ratios.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> int:
    """Simulate one synchronous job under faults: effective training time, lost time by cause,
    faults by recovery level, and the best checkpoint interval (--ckpt-interval auto)."""
    if trace is flt.TraceKind.EXPONENTIAL and mtbf_h is None:
        raise typer.BadParameter("the exponential trace needs --mtbf-h", param_hint="--mtbf-h")
    if trace is flt.TraceKind.LLAMA3 and mtbf_h is not None:
        raise typer.BadParameter("--mtbf-h applies to the exponential trace only")
    requested_s = _parse_interval(ckpt_interval)
    settings = sim_settings.SimSettings()
    if settings_file is not None:
        try:
            settings = sim_settings.load(settings_file)
        except sim_settings.SettingsError as exc:
            print(f"aegis: error: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
    spec = engine.SimSpec(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        days=days,
        trace=trace,
        mtbf_s=None if mtbf_h is None else mtbf_h * 3600.0,
        ckpt_cost_s=ckpt_cost_s,
        policy=policy,
        seed=seed,
        max_retry=max_retry,
        settings=settings,
    )
    choice = report.choose_interval(spec, requested_s)
    spec = replace(spec, ckpt_interval_s=choice.interval_s)
    started = time.perf_counter()
    result = engine.run(spec)
    runtime_s = time.perf_counter() - started
    other = None
    if compare:
        other_policy = (
            rc.Policy.RESTART_FROM_CHECKPOINT if policy is rc.Policy.AEGIS else rc.Policy.AEGIS
        )
        other = engine.run(replace(spec, policy=other_policy))
    aegis, baseline = (result, other) if policy is rc.Policy.AEGIS else (other, result)
    if as_json:
        record = report.to_dict(result, choice, runtime_s)
        if other is not None:
            record["compare"] = {other.spec.policy.value: other.ratio}
        print(json.dumps(record))
    else:
        lines = report.text_lines(result, choice, runtime_s)
        if compare:
            lines += report.comparison_lines(aegis, baseline)
        print("\n".join(lines))
    raise typer.Exit(0)


def _parse_interval(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        minutes = float(text)
    except ValueError:
        raise typer.BadParameter(
            f"expected minutes or 'auto', got {text!r}", param_hint="--ckpt-interval"
        ) from None
    if minutes <= 0:
        raise typer.BadParameter("must be > 0 minutes", param_hint="--ckpt-interval")
    return minutes * 60.0
