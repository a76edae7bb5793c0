"""Torch distributed checkpoints (DCP) through Aegis: ``Writer`` and ``Reader``.

``dcp.save(state, storage_writer=aegis.checkpoint.dcp.Writer())``, ``dcp.async_save(...)`` and
``dcp.load(state, storage_reader=aegis.checkpoint.dcp.Reader())`` copy each rank's shards into its
pod's shared memory (one copy) and return; the pod's saver daemon persists them in DCP's own
on-disk format under ``<checkpoint root>/step-<N>/`` and reports the commit to the master as any
Aegis checkpoint. A load takes the newest checkpoint every rank still holds in shared memory
(after an in-place restart: no file read), else the newest complete one on disk, verified by
its CRCs (a corrupt one is skipped for the previous one). :mod:`.slot` and :mod:`.zipimage` are
torch-free (the daemon uses them); ``Writer`` and ``Reader`` import torch when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aegis.checkpoint.dcp.reader import Reader
    from aegis.checkpoint.dcp.writer import Writer

__all__ = ["Reader", "Writer"]


def __getattr__(name: str) -> Any:
    if name == "Writer":
        from aegis.checkpoint.dcp import writer

        return writer.Writer
    if name == "Reader":
        from aegis.checkpoint.dcp import reader

        return reader.Reader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
