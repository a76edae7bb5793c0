"""Training-side checkpoint API (DESIGN section 7): ``save(step, state)`` and ``load_latest()``.

``save`` copies the tensors of a (nested) state dict into shared memory owned by the pod's agent
and returns; the saver daemon (:mod:`aegis.checkpoint.daemon`, kept alive by the agent through
:class:`aegis.checkpoint.process.DaemonProcess`) persists it in the background with checksums and
a commit marker. ``load_latest`` reads the newest committed copy from shared memory after an
in-place restart, else the newest valid committed copy on disk. A save never drops silently:
while the previous one is being persisted the default policy ``wait`` blocks (``raise`` raises
:class:`SaverBusyError`). Configured by the environment: ``AEGIS_CKPT_SHM``, ``AEGIS_CKPT_DIR``,
``AEGIS_CKPT_POLICY``, ``AEGIS_CKPT_WAIT_S``. Importing this package does not import torch.
"""

from __future__ import annotations

import functools
from typing import Any

from aegis.checkpoint.api import BusyPolicy, Saver, SaverBusyError, SaverSettings

__all__ = ["BusyPolicy", "Saver", "SaverBusyError", "SaverSettings", "load_latest", "save"]


@functools.cache
def _saver(settings: SaverSettings) -> Saver:
    """One Saver per settings, so the shared-memory buffers stay mapped between saves."""
    return Saver(settings)


def save(step: int, state_dict: Any) -> None:
    """Copy ``state_dict`` into shared memory for step ``step``; the daemon persists it."""
    _saver(SaverSettings.from_env()).save(step, state_dict)


def load_latest(template: Any = None) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest committed checkpoint (shared memory first), or None."""
    return _saver(SaverSettings.from_env()).load_latest(template)
