"""``aegis status JOB [--log-dir D | --nats URL [--auth-file F] [--tls-ca CA] | --ctl-file F]
[--json]``: the user-facing summary and the per-pod table.

Read from the job's log directory (``events.jsonl`` replayed through the core: a finished run,
or a running ``aegis run``, whose event log is flushed per line), or from a running master's
store (``--nats``: the job's record in the JetStream KV status bucket, connected as
``aegis master`` connects; ``--ctl-file``: the control file of an ``aegis run``, as
``aegis ctl`` connects).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from aegis.adapters.nats_auth import Authority
from aegis.cli import options, render, status_store
from aegis.master import control_file
from aegis.tools import joblog, status_summary
from aegis.wire import eventlog, job_summary

LogDirOption = Annotated[
    Path | None,
    typer.Option(help="The job's log directory (default: $AEGIS_LOG_DIR, else the newest "
                 "aegis run directory of JOB in the temporary directory)."),
]  # fmt: skip


NatsOption = Annotated[
    str | None,
    typer.Option(
        help="Read the job from a running master's store on this NATS server.",
        callback=options.nats_url,
    ),
]
AuthFileOption = Annotated[
    Path | None, typer.Option(help="With --nats: the keys file the master replicas load.")
]
TlsCaOption = Annotated[
    Path | None, typer.Option(help="With --nats: trust this CA only (a NATS server with TLS).")
]
CtlFileOption = Annotated[
    Path | None, typer.Option(help="Read the store of a running aegis run (its control file).")
]


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def load_or_exit(job: str, log_dir: Path | None) -> joblog.JobLog:
    try:
        log = joblog.load(joblog.find_log_dir(job, log_dir))
    except joblog.LogDirError as exc:
        print(f"aegis: error: {exc.detail}", file=sys.stderr)
        raise typer.Exit(2) from None
    except (OSError, eventlog.EventLogError) as exc:
        print(f"aegis: error: cannot read the event log of {job}: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    if log.torn_tail:
        print(joblog.torn_note(log.log_dir / joblog.EVENTS, log.torn_tail), file=sys.stderr)
    return log


def pod_table(summary: job_summary.Summary) -> Table:
    table = Table(title_justify="left", expand=False)
    watched = any(row.watchdog for row in summary.pods)
    scored = any(row.straggler_score is not None for row in summary.pods)
    columns = ("pod", "node", "inner phase", "retries", "last failure")
    extra = (("hang watchdog",) if watched else ()) + (("straggler score",) if scored else ())
    for column in (*columns, *extra):
        table.add_column(column)
    for row in summary.pods:
        cells = (row.pod, row.node or "-", row.inner_phase, str(row.retries),
                 row.last_failed_reason or "-")  # fmt: skip
        table.add_row(*cells, *((row.watchdog or "-",) if watched else ()),
                      *((straggler_cell(summary, row),) if scored else ()))  # fmt: skip
    return table


def straggler_cell(summary: job_summary.Summary, row: job_summary.PodRow) -> str:
    """The pod's straggler score in steps ("-": none), marked when it is the one named."""
    if row.straggler_score is None:
        return "-"
    named = " (straggler)" if row.pod == summary.straggler_pod else ""
    score = f"{row.straggler_score:.2f}"
    return f"{'0.00' if score == '-0.00' else score}{named}"


def _store_target(
    nats: str | None,
    auth_file: Path | None,
    ctl_file: Path | None,
    namespace: str | None,
    tls_ca: Path | None = None,
) -> status_store.StoreTarget:
    if ctl_file is not None:
        try:
            target = control_file.read_control_file(ctl_file)
        except (OSError, ValueError, KeyError) as exc:
            print(f"aegis: error: {control_file.unreadable(ctl_file, exc)}", file=sys.stderr)
            raise typer.Exit(2) from None
        return status_store.StoreTarget(target.nats_url, target.creds,
                                        namespace or target.namespace)  # fmt: skip
    assert nats is not None
    creds = None
    if auth_file is not None:
        try:
            creds = Authority.load(auth_file).master_creds()
        except (OSError, ValueError, KeyError) as exc:
            print(f"aegis: error: cannot read keys file {auth_file}: {exc}", file=sys.stderr)
            raise typer.Exit(2) from None
    return status_store.StoreTarget(nats, creds, namespace or "default", tls_ca)


def from_store_or_exit(
    job: str, target: status_store.StoreTarget, timeout_s: float
) -> job_summary.Summary:
    where = f"{target.nats_url} (namespace {target.namespace})"
    try:
        record = asyncio.run(status_store.read_record(target, job, timeout_s))
    except status_store.StoreReadError as exc:
        print(f"aegis: error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    if record is None:
        print(f"aegis: error: no job {job!r} in the store at {where}", file=sys.stderr)
        raise typer.Exit(1)
    try:
        return job_summary.from_record(record)
    except (KeyError, ValueError, TypeError) as exc:
        print(f"aegis: error: the record of {job!r} at {where} is not a job status: {exc!r}",
              file=sys.stderr)  # fmt: skip
        raise typer.Exit(1) from None


def status(  # noqa: PLR0913 (a typer command: one parameter per option)
    job: Annotated[str, typer.Argument(help="Job name.")],
    log_dir: LogDirOption = None,
    nats: NatsOption = None,
    auth_file: AuthFileOption = None,
    tls_ca: TlsCaOption = None,
    ctl_file: CtlFileOption = None,
    namespace: Annotated[
        str | None, typer.Option(help="The job's namespace in the store (default: default).")
    ] = None,
    timeout_s: Annotated[float, typer.Option(min=0.1, help="Seconds to wait for NATS.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Print the job's phase, the user-facing restart line and the per-pod table."""
    if sum(x is not None for x in (log_dir, nats, ctl_file)) > 1:
        print("aegis: error: pass one of --log-dir, --nats, --ctl-file", file=sys.stderr)
        raise typer.Exit(2)
    for name, given in (("--auth-file", auth_file), ("--tls-ca", tls_ca)):
        if given is not None and nats is None:
            print(f"aegis: error: {name} goes with --nats", file=sys.stderr)
            raise typer.Exit(2)
    if nats is not None or ctl_file is not None:
        target = _store_target(nats, auth_file, ctl_file, namespace, tls_ca)
        summary = from_store_or_exit(job, target, timeout_s)
        source = f"store: {target.nats_url}"
    else:
        log = load_or_exit(job, log_dir)
        summary = status_summary.from_log(log)
        source = f"logs: {log.log_dir}"
    if as_json:
        print(json.dumps(summary.to_dict(), indent=2))
        raise typer.Exit(0)
    out = render.make_console()
    out.print(f"job {summary.job}: {summary.outcome}")
    out.print(summary.user_line)
    if summary.error_nodes:
        out.print(f"error nodes: {', '.join(summary.error_nodes)}")
    if summary.straggler:
        out.print(f"straggler: {summary.straggler}")
    out.print(pod_table(summary))
    out.print(source)
    raise typer.Exit(0)
