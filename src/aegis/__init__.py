"""Aegis: fault tolerance for synchronous distributed training."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["__version__", "progress"]

__version__ = "0.1.0"

_report: Callable[[int], bool] | None = None


def progress(step: int) -> bool:
    """Tell the Aegis agent that training reached ``step`` (cheap; a no-op without an agent).

    Returns True when the master asked for a checkpoint that is due now (before a drain or an
    eviction): save one, e.g. with ``aegis.checkpoint.save_if_requested(step, state)``."""
    report = _report
    if report is None:
        report = _load_report()
    return report(step)


def _load_report() -> Callable[[int], bool]:
    global _report
    from aegis import training as progress_module

    _report = progress_module.report
    return _report
