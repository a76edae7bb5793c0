"""The options ``aegis run`` and ``aegis master`` share: one definition each."""

from __future__ import annotations

from typing import Annotated

import typer

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
