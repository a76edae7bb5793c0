"""``aegis status JOB [--log-dir D] [--json]``: the user-facing summary and the per-pod table.

Read from the job's log directory (``events.jsonl`` replayed through the core: a finished run,
or a running ``aegis run``, whose event log is flushed per line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from aegis.cli import render
from aegis.tools import joblog, status_summary
from aegis.wire import eventlog

LogDirOption = Annotated[
    Path | None,
    typer.Option(help="The job's log directory (default: $AEGIS_LOG_DIR, else the newest "
                 "aegis run directory of JOB in the temporary directory)."),
]  # fmt: skip


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def load_or_exit(job: str, log_dir: Path | None) -> joblog.JobLog:
    try:
        return joblog.load(joblog.find_log_dir(job, log_dir))
    except joblog.LogDirError as exc:
        print(f"aegis: error: {exc.detail}", file=sys.stderr)
        raise typer.Exit(2) from None
    except (OSError, eventlog.EventLogError) as exc:
        print(f"aegis: error: cannot read the event log of {job}: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


def pod_table(summary: status_summary.Summary) -> Table:
    table = Table(title_justify="left", expand=False)
    for column in ("pod", "node", "inner phase", "retries", "last failure"):
        table.add_column(column)
    for row in summary.pods:
        table.add_row(row.pod, row.node or "-", row.inner_phase, str(row.retries),
                      row.last_failed_reason or "-")  # fmt: skip
    return table


def status(
    job: Annotated[str, typer.Argument(help="Job name.")],
    log_dir: LogDirOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Print the job's phase, the user-facing restart line and the per-pod table."""
    log = load_or_exit(job, log_dir)
    summary = status_summary.from_log(log)
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
        raise typer.Exit(0)
    out = render.make_console()
    quit_note = " (should_quit)" if summary.should_quit else ""
    out.print(f"job {summary.job}: {summary.phase.value}{quit_note}")
    out.print(summary.user_line)
    if summary.error_nodes:
        out.print(f"error nodes: {', '.join(summary.error_nodes)}")
    out.print(pod_table(summary))
    out.print(f"logs: {log.log_dir}")
    raise typer.Exit(0)
