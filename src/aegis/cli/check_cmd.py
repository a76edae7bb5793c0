"""``aegis check NAME [--json]``: one check on this node (exit 0 pass or not applicable, 1 fail)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from aegis.checks import base, suites
from aegis.core.recovery import CheckType
from aegis.spawn.ports import free_port
from aegis.wire.messages import CheckResult


def register(app: typer.Typer) -> None:
    app.command("check")(check)


def _existing_dir(path: Path) -> Path:
    """``--scratch-dir``: a directory that is there (the check writes in it; it made a missing
    one and left it)."""
    if not path.is_dir():
        raise typer.BadParameter(f"{path} is not a directory")
    return path


def check(  # noqa: PLR0913 (a typer command: one parameter per option)
    name: Annotated[str, typer.Argument(help="io, gpu, runtime, rdma, allreduce_connect, ...")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    scratch_dir: Annotated[
        Path, typer.Option(help="Directory the io check writes in.", callback=_existing_dir)
    ] = Path("/tmp"),
    require_gpu: Annotated[bool, typer.Option(help="Fail gpu/runtime without a GPU.")] = False,
    budget_s: Annotated[
        float | None, typer.Option(min=0.001, help="Budget of the check, in seconds.")
    ] = None,
    rank: Annotated[int, typer.Option(min=0, help="allreduce_*: this pod's rank.")] = 0,
    world_size: Annotated[int, typer.Option(min=1, help="allreduce_*: pods in the group.")] = 1,
    master_addr: Annotated[str, typer.Option(help="allreduce_*: rendezvous host.")] = "127.0.0.1",
    master_port: Annotated[
        int, typer.Option(min=0, max=65535, help="allreduce_*: rendezvous port (0: free).")
    ] = 0,
    slow_factor: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="allreduce_perf: slow below this x peers.")
    ] = base.PerfSettings().slow_factor,
) -> int:
    """Run one check; exit 0 when it passes (or does not apply), 1 when it fails."""
    try:
        check_type = CheckType(name)
    except ValueError:
        choices = ", ".join(t.value for t in CheckType)
        typer.echo(f"aegis: error: unknown check {name!r} (one of: {choices})", err=True)
        raise typer.Exit(2) from None
    if rank >= world_size:
        raise typer.BadParameter(f"rank {rank} of a group of {world_size}", param_hint="--rank")
    if check_type in suites.COLLECTIVE:
        info = base.GroupInfo(rank, world_size, master_addr, master_port or free_port())
    else:
        info = None
    budgets = dict(base.DEFAULT_BUDGETS_S)
    if budget_s is not None:
        budgets[check_type] = budget_s
    settings = base.CheckSettings(
        scratch_dir=scratch_dir,
        budgets_s=budgets,
        require_gpu=require_gpu,
        group=info,
        perf=base.PerfSettings(slow_factor=slow_factor),
    )
    result = asyncio.run(base.run_one(check_type, suites.CHECKS[check_type], settings))
    print_result(result, as_json)
    raise typer.Exit(0 if result.passed else 1)


def print_result(result: CheckResult, as_json: bool) -> None:
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "check": result.check_type.value,
                    "passed": result.passed,
                    "not_applicable": result.not_applicable,
                    "result": result.result,
                    "duration_s": result.duration_s,
                    "ts": result.ts,
                }
            )
        )
        return
    verdict = "n/a " if result.not_applicable else ("pass" if result.passed else "FAIL")
    typer.echo(f"{verdict} {result.check_type.value} ({result.duration_s:.2f} s): {result.result}")
