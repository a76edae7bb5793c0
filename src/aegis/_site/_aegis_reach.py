"""Makes ``aegis`` importable in a job's interpreter that has none of its own.

The agent may run from another environment than the training command's (its own virtualenv in
the image, the job's in conda): there ``import aegis`` fails, and with it the progress and dying
hooks and the zygote. The parts of Aegis a training process loads (``aegis.autoprogress``,
``aegis.training``, ``aegis.flight``, ``aegis.forking``, the zygote) use the standard library
only, so :func:`install` lets that interpreter import the ``aegis`` package this file belongs to:
a finder at the end of ``sys.meta_path`` that answers for the name ``aegis`` alone, from the
folder that holds it. An ``aegis`` of the interpreter's own is found first; nothing else of the
agent's environment (its torch, its numpy) ever becomes importable. Standard library only.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class AegisOnly:
    """A meta path finder for the top-level name ``aegis``, from :data:`ROOT` only."""

    aegis_reach = True

    @classmethod
    def find_spec(
        cls, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "aegis":
            return None
        return importlib.machinery.PathFinder.find_spec(name, [ROOT])


def install() -> None:
    """Add the finder once (last: it is asked only when nothing else found ``aegis``)."""
    if not any(getattr(finder, "aegis_reach", False) for finder in sys.meta_path):
        sys.meta_path.append(AegisOnly)
