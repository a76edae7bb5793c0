"""The records of a ``torch.save`` archive of one contiguous tensor, without its data."""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
from typing import Any

import torch

import aegis.checkpoint.dcp.zipimage as zipimg  # by path: the dcp package imports lazily

ARCHIVE = "archive"


class _Storage:
    """Stands for the tensor's storage in the pickle (a persistent id, as torch.save writes)."""


class _Tensor:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes

    def __reduce__(self) -> tuple[Any, ...]:
        strides = tuple(math.prod(self.sizes[i + 1 :]) for i in range(len(self.sizes)))
        rebuild = torch._utils._rebuild_tensor_v2
        return (rebuild, (_Storage(), 0, self.sizes, strides, False, collections.OrderedDict()))


@functools.lru_cache(maxsize=1024)
def records(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[zipimg.Record, ...]:
    """What ``torch.load(..., weights_only=True)`` needs to rebuild a ``dtype`` tensor of
    ``sizes`` (contiguous, storage offset 0) from the bytes of ``data/0``."""
    numel = math.prod(sizes)
    api: Any = torch  # (torch's storage classes carry no annotations)
    storage = api.TypedStorage(wrap_storage=api.UntypedStorage(0), dtype=dtype, _internal=True)
    storage_class = getattr(torch, storage._pickle_storage_type())
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=2)
    pickler.persistent_id = (  # type: ignore[method-assign]
        lambda obj: (
            ("storage", storage_class, "0", "cpu", numel) if isinstance(obj, _Storage) else None
        )
    )
    pickler.dump(_Tensor(sizes))
    nbytes = numel * dtype.itemsize
    return (
        zipimg.Record("data.pkl", out.getvalue()),
        zipimg.Record(".format_version", b"1"),
        zipimg.Record(".storage_alignment", b"64"),
        zipimg.Record("byteorder", b"little"),
        zipimg.Record("data/0", None, nbytes),
        zipimg.Record("version", b"3\n"),
    )


def image(dtype: torch.dtype, sizes: tuple[int, ...]) -> list[zipimg.Piece]:
    return zipimg.plan(ARCHIVE, records(dtype, sizes))
