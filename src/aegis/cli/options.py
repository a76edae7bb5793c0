"""The pace watch's options, shared by ``aegis run`` and ``aegis master``."""

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
