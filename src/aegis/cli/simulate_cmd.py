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


# The options of ``aegis simulate``, one alias each, so the command's function stays short.
MAX_INTERVAL_MIN = 1e6  # about two years
Gpus = Annotated[int, typer.Option(min=1, help="GPUs in the job.")]
GpusPerNode = Annotated[int, typer.Option(min=1, help="GPUs per node (one pod each).")]
Days = Annotated[float, typer.Option(min=0.001, max=3650.0, help="Wall time simulated, in days.")]
Trace = Annotated[
    flt.TraceKind,
    typer.Option(help="llama3: Llama 3's 419 faults/54 days/2,048 nodes, scaled by nodes."),
]
MtbfH = Annotated[
    float | None,
    typer.Option(min=0.0001, max=1e6, help="Job MTBF in hours (exponential trace)."),
]
CkptInterval = Annotated[
    str,
    typer.Option(
        help="Minutes of training between checkpoints, or 'auto': the interval that "
        "maximises Daly's expected-value model (his higher-order optimum)."
    ),
]
CkptCost = Annotated[
    float,
    typer.Option(min=0.0, max=86400.0, help="Seconds training pauses for each checkpoint save."),
]
PolicyOption = Annotated[rc.Policy, typer.Option(help="Who recovers from faults.")]
Seed = Annotated[int, typer.Option(help="Seed of the fault trace (same seed, same run).")]
MaxRetry = Annotated[
    int,
    typer.Option(
        min=0,
        help="The job's fault budget in the real core. Large by default: over 54 days at "
        "16k GPUs hundreds of faults arrive and any small budget would end the job; a "
        "Failed job is reported, then simulated as resubmitted.",
    ),
]
SettingsFile = Annotated[
    Path | None,
    typer.Option("--settings", help="Durations (TOML or JSON); see examples/simulate/."),
]
Compare = Annotated[bool, typer.Option(help="Also run the other policy and print both ratios.")]
AsJson = Annotated[bool, typer.Option("--json", help="One JSON object.")]


def simulate(  # noqa: PLR0913 (a typer command: one parameter per option)
    gpus: Gpus = 16_384,
    gpus_per_node: GpusPerNode = 8,
    days: Days = 54.0,
    trace: Trace = flt.TraceKind.LLAMA3,
    mtbf_h: MtbfH = None,
    ckpt_interval: CkptInterval = "auto",
    ckpt_cost_s: CkptCost = 10.0,
    policy: PolicyOption = rc.Policy.AEGIS,
    seed: Seed = 0,
    max_retry: MaxRetry = 10_000,
    settings_file: SettingsFile = None,
    compare: Compare = True,
    as_json: AsJson = False,
) -> int:
    """Simulate one synchronous job under faults: effective training time, lost time by cause,
    faults by recovery level, and the best checkpoint interval (--ckpt-interval auto)."""
    if trace is flt.TraceKind.EXPONENTIAL and mtbf_h is None:
        raise typer.BadParameter("the exponential trace needs --mtbf-h", param_hint="--mtbf-h")
    if trace is flt.TraceKind.LLAMA3 and mtbf_h is not None:
        raise typer.BadParameter("--mtbf-h applies to the exponential trace only")
    requested_s = _parse_interval(ckpt_interval)
    spec = engine.SimSpec(
        gpus=gpus, gpus_per_node=gpus_per_node, days=days, trace=trace,
        mtbf_s=None if mtbf_h is None else mtbf_h * 3600.0, ckpt_cost_s=ckpt_cost_s,
        policy=policy, seed=seed, max_retry=max_retry, settings=_settings(settings_file),
    )  # fmt: skip
    print(_report(spec, requested_s, compare=compare, as_json=as_json))
    raise typer.Exit(0)


def _settings(settings_file: Path | None) -> sim_settings.SimSettings:
    """The durations: the defaults, or ``--settings``'s (exit 2, one line, when bad)."""
    if settings_file is None:
        return sim_settings.SimSettings()
    try:
        return sim_settings.load(settings_file)
    except sim_settings.SettingsError as exc:
        print(f"aegis: error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


def _report(
    spec: engine.SimSpec, requested_s: float | None, *, compare: bool, as_json: bool
) -> str:
    """Run the simulation (and the other policy's with ``compare``) at the interval chosen;
    the report, as text lines or one JSON object."""
    choice = report.choose_interval(spec, requested_s)
    spec = replace(spec, ckpt_interval_s=choice.interval_s)
    started = time.perf_counter()
    result = engine.run(spec)
    runtime_s = time.perf_counter() - started
    other = None
    if compare:
        other_policy = (
            rc.Policy.RESTART_FROM_CHECKPOINT if spec.policy is rc.Policy.AEGIS else rc.Policy.AEGIS
        )
        other = engine.run(replace(spec, policy=other_policy))
    if as_json:
        record = report.to_dict(result, choice, runtime_s)
        if other is not None:
            record["compare"] = {other.spec.policy.value: other.ratio}
        return json.dumps(record)
    lines = report.text_lines(result, choice, runtime_s)
    if compare:
        aegis, baseline = (result, other) if spec.policy is rc.Policy.AEGIS else (other, result)
        lines += report.comparison_lines(aegis, baseline)
    return "\n".join(lines)


def _parse_interval(text: str) -> float | None:
    if text == "auto":
        return None
    try:
        minutes = float(text)
    except ValueError:
        raise typer.BadParameter(
            f"expected minutes or 'auto', got {text!r}", param_hint="--ckpt-interval"
        ) from None
    if not 0 < minutes <= MAX_INTERVAL_MIN:  # nan, inf too: no figure would mean anything
        raise typer.BadParameter(
            f"must be > 0 and at most {MAX_INTERVAL_MIN:g} minutes, got {text!r}",
            param_hint="--ckpt-interval",
        )
    return minutes * 60.0
