"""``aegis agent [options] -- CMD...``: the PID-1 agent (tini-like without a master)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from aegis.adapters import tls
from aegis.agent import runner, signatures, supervisor, warm
from aegis.cli import options, paths

LOG_LEVEL_VAR = "AEGIS_LOG_LEVEL"


def register(app: typer.Typer) -> None:
    app.command(
        "agent",
        context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
    )(agent)


def parse_master(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected HOST:PORT, got {value!r}", param_hint="--master")
    return host.strip("[]"), int(port)


# The options of ``aegis agent``, one alias each, so the command's function stays short.
Cmd = Annotated[list[str], typer.Argument(help="The command; one string runs under 'bash -c'.")]
Grace = Annotated[float, typer.Option(min=0, help="Seconds between SIGTERM and SIGKILL on stop.")]
HangTimeout = Annotated[
    float | None,
    typer.Option(
        min=0,
        help="Report a hang after this long without progress; 0: off; default: "
        "calibrated from the run (10 x p99 step within 30..600 s; no step signal: "
        "60 s with no output and no CPU).",
    ),
]
Master = Annotated[str | None, typer.Option(help="The master, HOST:PORT.")]
Job = Annotated[str | None, typer.Option(help="This pod's job.")]
Pod = Annotated[str | None, typer.Option(help="This pod's name.")]
TokenFile = Annotated[
    str | None, typer.Option(help="The bootstrap token file.", callback=paths.readable_file)
]
TlsCa = Annotated[
    Path | None,
    typer.Option(
        help="Speak TLS to the master and NATS, trusting this CA certificate only "
        "(ca.crt of the master's --tls-dir)."
    ),
]
Namespace = Annotated[str, typer.Option(help="This pod's job namespace.")]
Node = Annotated[str, typer.Option(envvar="AEGIS_NODE", help="The node this pod runs on.")]
Heartbeat = Annotated[
    float, typer.Option(min=0.05, help="Seconds between heartbeats to the master.")
]
ConnectTimeout = Annotated[
    float, typer.Option(min=0, help="Run independently when the master is silent this long.")
]
Rejoin = Annotated[
    bool,
    typer.Option(
        help="This pod is placed again in a running job (its platform says so): never run the "
        "command independently; keep trying to reach the master."
    ),
]
SignatureFile = Annotated[
    Path | None, typer.Option("--signatures", help="A TOML file of extra log signatures.")
]
KeepLines = Annotated[int, typer.Option(min=1, help="Last output lines kept as evidence.")]
Prewarm = Annotated[
    str | None,
    typer.Option(
        envvar=warm.ENV_VAR,
        help="Restart a Python command warm from a zygote that imported these modules "
        "('torch,numpy'); 'auto' (default): the script's imports and the native packages of "
        "its first run; '0': cold restarts. Only under --master (restarts come from it).",
    ),
]
NoPrewarm = Annotated[
    bool, typer.Option("--no-prewarm", help="Cold restarts (same as --prewarm 0).")
]


def agent(  # noqa: PLR0913 (a typer command: one parameter per option)
    cmd: Cmd,
    grace_s: Grace = 10.0,
    hang_timeout_s: HangTimeout = None,
    master: Master = None,
    job: Job = None,
    pod: Pod = None,
    token_file: TokenFile = None,
    tls_ca: TlsCa = None,
    namespace: Namespace = "default",
    node: Node = "",
    heartbeat_s: Heartbeat = 1.0,
    health_s: options.HealthEvery = 30.0,
    connect_timeout_s: ConnectTimeout = 10.0,
    rejoin: Rejoin = False,
    signature_file: SignatureFile = None,
    keep_lines: KeepLines = 50,
    prewarm: Prewarm = None,
    no_prewarm: NoPrewarm = False,
) -> None:
    """Run CMD like tini (own process group, signals forwarded, zombies reaped, its exit status)."""
    argv = ["bash", "-c", cmd[0]] if len(cmd) == 1 else list(cmd)
    table = _signatures(signature_file)
    if tls_ca is not None:
        try:
            tls.check_ca(tls_ca)
        except tls.TlsConfigError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tls-ca") from None
    master_settings = None
    if master is not None:
        host, port = parse_master(master)
        master_settings = runner.MasterAddress(
            host, port, job, pod, token_file, connect_timeout_s=connect_timeout_s,
            namespace=namespace, node=node, heartbeat_s=heartbeat_s, tls_ca=tls_ca, rejoin=rejoin,
            health_s=health_s,
        )  # fmt: skip
    settings = runner.AgentSettings(
        supervisor=supervisor.SupervisorSettings(
            grace_s=grace_s, hang_timeout_s=hang_timeout_s, keep_lines=keep_lines,
            signatures=table, foreground=True,
            prewarm=_prewarm(prewarm, off=no_prewarm or master is None),
        ),
        master=master_settings,
    )  # fmt: skip
    _log_to_stderr()
    raise typer.Exit(runner.main(settings, argv))


def _signatures(signature_file: Path | None) -> tuple[signatures.Signature, ...]:
    """The log signatures: the defaults, or ``--signatures``'s (a usage error when bad)."""
    if signature_file is None:
        return signatures.DEFAULT_SIGNATURES
    try:
        return signatures.load(signature_file)
    except signatures.SignatureConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--signatures") from exc


def _prewarm(value: str | None, *, off: bool) -> warm.PrewarmSettings | None:
    """The warm restarts' settings, where used. A ``--prewarm`` that names no module is a usage
    error; such an ``AEGIS_PREWARM`` (the pod's environment: under ``aegis run``, the user's
    shell) turns them off with a warning, and the pod runs."""
    if off:
        return None
    if os.environ.get(warm.ENV_VAR) != value:  # given on the command line
        return options.prewarm_settings(value)
    try:
        return warm.settings_from(value)
    except warm.PrewarmError as exc:
        print(f"aegis agent: warning: {warm.ENV_VAR}: {exc}; cold restarts", file=sys.stderr)
        return None


def _log_to_stderr() -> None:
    if not logging.getLogger().handlers:
        level = os.environ.get(LOG_LEVEL_VAR, "")  # e.g. INFO: timestamped, for benchmarks
        if level and not isinstance(logging.getLevelName(level.upper()), int):
            print(f"aegis agent: warning: {LOG_LEVEL_VAR}={level!r} is no log level (DEBUG, "
                  "INFO, WARNING, ERROR): WARNING", file=sys.stderr)  # fmt: skip
            level = ""
        logging.basicConfig(
            stream=sys.stderr,
            level=level.upper() or logging.WARNING,
            format=f"aegis agent: {'%(asctime)s ' if level else ''}%(message)s",
        )
