"""Aegis: fault tolerance for synchronous distributed training."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["__version__", "progress"]

__version__ = "0.1.0"

_report: Callable[[int], None] | None = None


def progress(step: int) -> None:
    """Tell the Aegis agent that training reached ``step`` (cheap; a no-op without an agent)."""
    report = _report
    if report is None:
        report = _load_report()
    report(step)


def _load_report() -> Callable[[int], None]:
    global _report
    from aegis.agent import progress as progress_module

    _report = progress_module.report
    return _report
