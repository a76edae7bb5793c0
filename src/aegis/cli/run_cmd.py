"""``aegis run [options] -- CMD...``: the local platform with embedded NATS and master."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from aegis.cli import run_view
from aegis.platforms import local_run


def register(app: typer.Typer) -> None:
    app.command(
        "run", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True}
    )(run)


def parse_injections(values: list[str]) -> dict[str, frozenset[str]]:
    """``NODE:CHECK`` pairs into node -> checks; a malformed one is a usage error."""
    from aegis.core.recovery import CheckType

    known = {c.value for c in CheckType} | {"slow"}
    table: dict[str, set[str]] = {}
    for value in values:
        node, sep, check = value.partition(":")
        if not sep or not node or check not in known:
            raise typer.BadParameter(
                f"expected NODE:CHECK with CHECK one of {', '.join(sorted(known))}, got {value!r}",
                param_hint="--inject-fault",
            )
        table.setdefault(node, set()).add(check)
    return {node: frozenset(checks) for node, checks in table.items()}


def run(
    cmd: Annotated[list[str], typer.Argument(help="The training command (after --).")],
    nodes: Annotated[int, typer.Option(min=1, max=64, help="Pods (one per node).")] = 3,
    max_retry: Annotated[int, typer.Option(min=0, help="Fault budget.")] = 3,
    spare_nodes: Annotated[int, typer.Option(min=0, help="Spare nodes for replacements.")] = 2,
    hang_timeout_s: Annotated[float, typer.Option(min=0, help="0: no hang watchdog.")] = 0.0,
    heartbeat_timeout_s: Annotated[float, typer.Option(min=0.5)] = 5.0,
    grace_s: Annotated[float, typer.Option(min=0)] = 5.0,
    job: Annotated[str, typer.Option(help="Job name.")] = "job",
    status_file: Annotated[Path | None, typer.Option(help="Write the final status here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="events.jsonl, pod logs.")] = None,
    nats: Annotated[str | None, typer.Option(help="Use this NATS server (no auth).")] = None,
    inject_fault: Annotated[
        list[str] | None, typer.Option(help="NODE:CHECK, e.g. node-1:gpu (repeatable).")
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run CMD on --nodes local pods under Aegis; exit 0 when the job Succeeds, 1 when it Fails."""
    settings = local_run.RunSettings(
        command=tuple(["bash", "-c", cmd[0]] if len(cmd) == 1 else cmd),
        nodes=nodes,
        spare_nodes=spare_nodes,
        max_retry=max_retry,
        job=job,
        hang_timeout_s=hang_timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        grace_s=grace_s,
        log_dir=log_dir,
        status_file=status_file,
        nats_url=nats,
        inject=parse_injections(inject_fault or []),
    )
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    view = run_view.PlainView()
    result = asyncio.run(local_run.run_local(settings, observe=view.attach))
    status = result.status
    retries = ",".join(str(i.retries) for _, i in sorted(status.pod_infos.items()))
    print(
        f"aegis run: job {result.spec.job} {status.phase.value}; recover_count "
        f"{status.recover_count}/{result.spec.max_retry}, retries ({retries}); "
        f"error nodes: {', '.join(e.node for e in status.error_nodes) or 'none'}; "
        f"logs in {result.log_dir}"
    )
    raise typer.Exit(result.exit_code)
