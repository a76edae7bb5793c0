"""Training-side checkpoint API (DESIGN section 7): ``save(step, state)`` and ``load_latest()``.

``save`` copies the tensors of a (nested) state dict into shared memory owned by the pod's agent
and returns; the saver daemon (:mod:`aegis.checkpoint.daemon`, kept alive by the agent through
:class:`aegis.checkpoint.process.DaemonProcess`) persists it in the background with checksums and
a commit marker. ``load_latest`` reads the newest committed copy from shared memory after an
in-place restart, else the newest valid committed copy on disk; under torch.distributed the
ranks agree on the step (every rank calls it: a rank whose copy is damaged takes every rank back
with it). A save never drops silently:
while the previous one is being persisted the default policy ``wait`` blocks (``raise`` raises
:class:`SaverBusyError`); while the durable directory fails (full, read-only, gone: the daemon
reports it, :mod:`aegis.checkpoint.outage`) a save goes on and replaces the unpersisted slot, so
shared memory keeps the newest save, which is persisted when the store works again. Configured
by the environment: ``AEGIS_CKPT_SHM``, ``AEGIS_CKPT_DIR``, ``AEGIS_CKPT_POLICY``,
``AEGIS_CKPT_WAIT_S``; where the pod runs several ranks (``LOCAL_WORLD_SIZE`` over 1, as
under ``torchrun --nproc-per-node``) local rank k uses ``local-<k>/`` of both directories
(:mod:`aegis.checkpoint.layout`). Importing this package does not import torch. What a state
holds besides its tensors is loaded with only the globals a checkpoint may name, as
``torch.load(weights_only=True)`` loads (:mod:`aegis.checkpoint.safe_pickle`): a class of the
training's own is allowed with ``torch.serialization.add_safe_globals``, else its first save
raises :class:`UnsafeCheckpointError`.

``save_if_requested(step, state)``, called every step, saves only when the master asked for a
checkpoint (a drain, or a slow node's eviction) and the step it named is reached: every rank
saves that same step. After saving it holds the training (reporting progress, so the hang
watchdog stays quiet) until the agent stops it for the move, or the hold ends; no step after
the checkpoint is done twice. A rank that sees the request only past its step saves there and
goes on without holding (the others wait for no one). Costs one mapped read per call when
nothing is requested.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aegis import training
from aegis.checkpoint import api
from aegis.checkpoint.api import BusyPolicy, Saver, SaverBusyError, SaverSettings, ShmFullError
from aegis.checkpoint.safe_pickle import UnsafeCheckpointError

__all__ = [
    "BusyPolicy",
    "Saver",
    "SaverBusyError",
    "SaverSettings",
    "ShmFullError",
    "UnsafeCheckpointError",
    "load_latest",
    "save",
    "save_if_requested",
]

log = logging.getLogger(__name__)
HOLD_POLL_S = 0.05


def save(step: int, state_dict: Any) -> None:
    """Copy ``state_dict`` into shared memory for step ``step``; the daemon persists it. In a
    script that takes requests (it calls ``save_if_requested``), a save while the master's
    request is pending answers it (and holds, as below)."""
    api.shared_saver(SaverSettings.from_env()).save(step, state_dict)
    if not training.takes_requests():
        return
    request = training.pending_request(None, opt_in=False)
    if request is not None:
        _answer_and_hold(request, step)


def load_latest(template: Any = None, *, agree: bool = True) -> tuple[int, Any] | None:
    """``(step, state)`` of the newest committed checkpoint (shared memory first), or None.
    Under torch.distributed, the same step on every rank (``Saver.load_latest``)."""
    return api.shared_saver(SaverSettings.from_env()).load_latest(template, agree=agree)


def save_if_requested(step: int, state: Any | Callable[[], Any]) -> bool:
    """Save ``state`` (or what the callable returns) if the master asked for a checkpoint due
    at ``step``; then hold until the agent stops this process or the request's hold ends.
    Returns whether it saved. A no-op (False) when not under an agent."""
    request = training.pending_request(step)
    if request is None:
        return False
    if step > request.target_step:
        log.warning("checkpoint request %d for step %d seen at step %d: saved late",
                    request.id, request.target_step, step)  # fmt: skip
    api.shared_saver(SaverSettings.from_env()).save(step, state() if callable(state) else state)
    _answer_and_hold(request, step)
    return True


def _answer_and_hold(request: training.Request, step: int) -> None:
    training.answer(request)
    if 0 < request.target_step < step:
        # seen late (its agent got the order after this rank passed the step): the other ranks
        # saved the named step and hold there, or have gone on; holding here would stop them
        # again, in this step's collective, where they report nothing and look hung
        return
    while time.monotonic() < request.hold_until:  # the move comes: do no step twice
        training.report(step)
        time.sleep(HOLD_POLL_S)
