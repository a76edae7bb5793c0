"""Aegis: fault tolerance for synchronous distributed training."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
