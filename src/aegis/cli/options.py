"""The options ``aegis run`` and ``aegis master`` share: one definition each."""

from __future__ import annotations

from typing import Annotated

import typer

from aegis.adapters.nats_text import server_list
from aegis.agent import warm
from aegis.core.model import NAME_MAX, name_problem
from aegis.master.metrics import MasterMetrics, MetricsServer
from aegis.master.pace import PaceSettings

_DEFAULTS = PaceSettings()
WINDOW_DEFAULT = _DEFAULTS.window_s
DROP_DEFAULT = _DEFAULTS.drop

PaceWindow = Annotated[
    float,
    typer.Option(
        min=0,
        help="Pace watch: training slower than --pace-drop of its own pace over this many "
        "seconds gets the checks (a slow node is found and evicted at a checkpoint); 0: off.",
    ),
]
PaceDrop = Annotated[
    float, typer.Option(min=0.01, max=0.99, help="Pace watch: the fraction that is slow.")
]
HeartbeatTimeout = Annotated[
    float, typer.Option(min=0.5, help="A pod without a heartbeat for this long is lost.")
]
HealthEvery = Annotated[
    float,
    typer.Option(
        min=0,
        help="Seconds between the agents' looks at their GPUs (NVML): warning signs drain "
        "the node before the GPU fails. 0: off.",
    ),
]
JoinTimeout = Annotated[
    float,
    typer.Option(
        min=0,
        help="A pod sent away (replaced, evicted or restarted) that has not joined again after "
        "this long: its node is blacklisted and the pod placed elsewhere; 0: wait for ever.",
    ),
]
MetricsPort = Annotated[
    int,
    typer.Option(
        min=0,
        max=65535,
        help="Serve Prometheus /metrics here (0: off; aegis run --masters N: master i on PORT+i).",
    ),
]


def nats_url(value: str | None) -> str | None:
    """The check of every ``--nats``: one readable line (exit 2) for a URL no server can be at
    (an empty one made nats-py retry for ever, deaf to Ctrl-C)."""
    if value is not None:
        try:
            server_list(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def job_name(value: str) -> str:
    """``--job``: one rule for every job name (``core.model.name_problem``); a usage error."""
    return _job_name(value, NAME_MAX)


def _job_name(value: str, max_len: int) -> str:
    problem = name_problem("job", value, max_len)
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="--job")
    return value


REQUEUED = "-r99"  # what a requeued Slurm attempt adds to its job's name (``attempt_job``)


def slurm_job_name(value: str) -> str:
    """``aegis slurm submit --job``: the rule, with room left for a requeued attempt's suffix
    (a name valid at the submit was refused at the first requeue, inside the allocation)."""
    return _job_name(value, NAME_MAX - len(REQUEUED))


def serve_metrics(hub: MasterMetrics, port: int, addr: str) -> MetricsServer:
    """``--metrics-port``'s server; a port taken or an address that is not this host's is a
    usage error (one line, exit 2), not a traceback."""
    try:
        return hub.serve(port, addr)
    except OSError as exc:
        raise typer.BadParameter(
            f"cannot serve /metrics on {addr}:{port}: {exc.strerror or exc}",
            param_hint="--metrics-port",
        ) from None


def prewarm_settings(value: str | None) -> warm.PrewarmSettings | None:
    """``--prewarm``'s settings; one that names no module is a usage error."""
    try:
        return warm.settings_from(value)
    except warm.PrewarmError as exc:
        raise typer.BadParameter(str(exc), param_hint="--prewarm") from None


def prewarm(value: str | None) -> str | None:
    """A typer callback: ``aegis run --prewarm`` that names no module is a usage error, not a
    warning in every pod's log later."""
    prewarm_settings(value)
    return value
