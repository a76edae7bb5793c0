"""A failover test's hook, not a part of the master's logic: a master that exits right after
it wrote a status in a given phase, before that round's orders go out (once: a marker file
remembers), so the test sees a new leader cover for it. ``aegis master`` installs it only when
``AEGIS_CHAOS_EXIT_AFTER_PERSIST`` names a phase and it has a ``--log-dir``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from aegis.core.model import JobStatus
from aegis.master.job_settings import AfterPersist

log = logging.getLogger(__name__)

ENV = "AEGIS_CHAOS_EXIT_AFTER_PERSIST"
MARKER = ".chaos-done"


def exit_after_persist(phase: str, marker: Path) -> AfterPersist:
    def after_persist(status: JobStatus) -> None:
        if status.phase.value == phase and not marker.exists():
            marker.touch()
            log.error("chaos: exiting after persisting %s, before its orders", phase)
            os._exit(137)

    return after_persist


def from_env(environ: Mapping[str, str], log_dir: Path | None) -> AfterPersist | None:
    phase = environ.get(ENV, "")
    if not phase or log_dir is None:
        return None
    return exit_after_persist(phase, log_dir / MARKER)
