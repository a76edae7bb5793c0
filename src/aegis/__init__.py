"""Aegis: fault tolerance for synchronous distributed training."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["__version__", "progress"]

__version__ = "0.1.0"

_report: list[Callable[[int], bool]] = []  # aegis.training.report, once loaded (no global)


def progress(step: int) -> bool:
    """Tell the Aegis agent that training reached ``step`` (cheap; a no-op without an agent).

    Returns True when the master asked for a checkpoint that is due now (before a drain or an
    eviction): save one, e.g. with ``aegis.checkpoint.save_if_requested(step, state)``."""
    if _report:
        return _report[0](step)
    return _load_report()(step)


def _load_report() -> Callable[[int], bool]:
    from aegis import training as progress_module

    _report[:] = [progress_module.report]
    return progress_module.report
