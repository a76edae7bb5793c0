"""``Writer``: DCP's ``StorageWriter`` (and ``AsyncStager``) into the pod's shared memory.

Each rank copies the tensors of its plan (every item of its local plan, before DCP's dedup, so
that its shared memory alone restores it) into the buffer :meth:`aegis.checkpoint.api.Saver.
reserve` hands out: in ``stage`` for ``dcp.async_save`` (``write_data`` then copies nothing), in
``write_data`` for ``dcp.save``. The file image of its items in DCP's format is planned at once
(:mod:`.torchsave`), so that ``write_data`` returns DCP's ``WriteResult`` with the final offsets;
the slot goes to the daemon at the end of ``write_data`` (the coordinator's in ``finish``, with
the pickled metadata: a coordinator's slot implies that every rank's is there).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, staging, storage
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint import planner as dpl
from torch.futures import Future

# Siblings by path: the dcp package imports this module lazily.
import aegis.checkpoint.dcp.slot as sl
import aegis.checkpoint.dcp.torchsave as torch_save
import aegis.checkpoint.dcp.zipimage as zip_image
from aegis.checkpoint import api, nested
from aegis.checkpoint import layout as lay

SUFFIX = ".distcp"


@dataclasses.dataclass(frozen=True)
class _Proposal:
    step: int


@dataclasses.dataclass(frozen=True)
class _Assignment:
    step: int
    rank: int
    ranks: int
    save: str  # the coordinator's id of this save: in every file name

    @property
    def file(self) -> str:
        return file_name(self.rank, self.save)


def file_name(rank: int, save: str) -> str:
    """A rank's file of one save. The save's id is in the name because a step can be saved
    again (after a restart resumed from an earlier one) into a directory where files of the
    unfinished first save are left: the coordinator waits for this save's files, never for
    those, and its ``.metadata`` names only this save's."""
    return f"__{rank}_{save}{SUFFIX}"


@dataclasses.dataclass
class _Staged:
    buffer: int
    base: torch.Tensor  # the buffer's mapping the staged tensors view
    used: int


@dataclasses.dataclass
class _Pending:
    slot: sl.DcpSlot
    blob: bytearray


def parse_step(checkpoint_id: Any) -> int | None:
    """A checkpoint id that names a step (an int of 0 or more, or ASCII digits), else None: not
    a bool, and not other digits ``str.isdigit`` accepts (``int("²")`` raises)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id if checkpoint_id >= 0 else None
    if isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        return int(checkpoint_id)
    return None


def checked_id(checkpoint_id: Any) -> Any:
    """``checkpoint_id`` as given (a step, a directory or None); ``ValueError`` for an int that
    names no step (a negative one, a bool), which DCP would take for a directory's name."""
    if isinstance(checkpoint_id, int) and parse_step(checkpoint_id) is None:
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: a step is an int of 0 or more "
                         "(or its digits), anything else a directory")  # fmt: skip
    return checkpoint_id


class Writer(storage.StorageWriter, staging.AsyncStager):
    """Saves through Aegis. ``checkpoint_id``: None (the next step), a step number, or a
    directory (written in DCP's format by the daemon, numbered as the next step)."""

    _synchronize_after_execute = False

    def __init__(self, root: str | os.PathLike[str] | None = None,
                 environ: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__()
        env = dict(os.environ if environ is None else environ)
        settings = api.SaverSettings.from_env(env)
        self._saver = api.shared_saver(settings)  # one per settings: the buffers stay mapped
        self._root = Path(root) if root is not None else sl.default_root(env)
        self._explicit: Any = None
        self._save_id = uuid.uuid4().hex
        self._rank = 0
        self._local_items: list[dpl.WriteItem] = []
        self._staged: _Staged | None = None
        self._pending: _Pending | None = None

    # -- DCP's StorageWriter -------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._explicit = checked_id(checkpoint_id)
        self._save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return checkpoint_id is None or parse_step(checkpoint_id) is not None

    def storage_meta(self) -> dmd.StorageMeta | None:
        return dmd.StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self._save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return str(self._explicit if self._explicit is not None else self._root)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: dpl.SavePlan) -> dpl.SavePlan:
        self._local_items = list(plan.items)
        return dataclasses.replace(plan, storage_data=_Proposal(self._proposed_step()))

    def prepare_global_plan(self, plans: list[dpl.SavePlan]) -> list[dpl.SavePlan]:
        step = max(p.storage_data.step for p in plans)
        save = uuid.uuid4().hex[:12]  # fresh each save (DCP resets a writer only given an id)
        return [dataclasses.replace(p, storage_data=_Assignment(step, i, len(plans), save))
                for i, p in enumerate(plans)]  # fmt: skip

    def write_data(
        self, plan: dpl.SavePlan, planner: dpl.SavePlanner
    ) -> Future[list[storage.WriteResult]]:
        assignment: _Assignment = plan.storage_data
        directory = self._directory(assignment.step)
        data = {item.index: planner.resolve_data(item) for item in self._items(plan)}
        buffer, base, places = self._place(assignment.step, data)
        blob = bytearray()
        index: dict[dmd.MetadataIndex, tuple[Any, ...]] = {}
        for key, value in data.items():
            if isinstance(value, io.BytesIO):
                index[key] = ("bytes", len(blob), len(value.getbuffer()))
                blob += value.getbuffer()
            else:
                index[key] = ("tensor", places[key], value.dtype, tuple(value.shape))
        pieces: list[sl.Piece] = []
        results, at = [], 0
        for item in plan.items:
            item_pieces = _item_pieces(index[item.index], blob)
            length = sum(n if k != "crc" else 4 for k, _, n in item_pieces)
            info = filesystem._StorageInfo(assignment.file, at, length)
            results.append(storage.WriteResult(item.index, length, info))
            pieces += item_pieces
            at += length
        index_blob = pickle.dumps(index)
        spot = (len(blob), len(index_blob))
        blob += index_blob
        slot = sl.DcpSlot(
            step=assignment.step, buffer=buffer, data_bytes=base, directory=directory,
            files=(sl.FileSpec(assignment.file, tuple(pieces)),), index=spot,
            wait_for=tuple(file_name(r, assignment.save) for r in range(assignment.ranks)
                           if r != assignment.rank),
            incarnation=self._saver.settings.incarnation,
        )  # fmt: skip
        self._staged = None
        self._pending = _Pending(slot, blob)
        if assignment.rank != 0:
            self._hand_off(dataclasses.replace(slot, wait_for=()), blob)
        future: Future[list[storage.WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: dmd.Metadata, results: list[list[storage.WriteResult]]) -> None:
        pending = self._pending
        assert pending is not None, "finish before write_data"
        metadata.version = filesystem.CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        meta = pickle.dumps(metadata)
        spot = (len(pending.blob), len(meta))
        pending.blob += meta
        self._hand_off(dataclasses.replace(pending.slot, metadata=spot), pending.blob)

    # -- AsyncStager: dcp.async_save stages into shared memory -----------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        tensors = [_local(t) for t in nested.leaves(state_dict) if isinstance(t, torch.Tensor)]
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total = lay.aligned(total + t.numel() * t.element_size())
        buffer, base = self._saver.reserve(self._proposed_step(), total)
        views = [_copy_into(base, at, t) for at, t in zip(offsets, tensors, strict=True)]
        self._staged = _Staged(buffer, base, total)
        left = iter(views)
        staged: dict[str, Any] = nested.rebuild(state_dict, lambda leaf, _: _replaced(leaf, left))
        return staged

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None

    # -- helpers ---------------------------------------------------------------------------

    def _proposed_step(self) -> int:
        explicit = parse_step(self._explicit)
        if explicit is not None:
            return explicit
        s = self._saver.settings
        return sl.next_step(s.shm_dir, self._root, s.resume_step)

    def _directory(self, step: int) -> Path:
        if self._explicit is not None and parse_step(self._explicit) is None:
            return Path(self._explicit).absolute()
        if self._root is None:
            raise ValueError("aegis.checkpoint.dcp.Writer: no checkpoint directory "
                             "(set AEGIS_DCP_DIR or AEGIS_CKPT_DIR, or pass root=)")  # fmt: skip
        return (self._root / f"step-{step}").absolute()

    def _items(self, plan: dpl.SavePlan) -> list[dpl.WriteItem]:
        """This rank's items on disk, then those DCP gave to another rank (kept in shm)."""
        assigned = {item.index for item in plan.items}
        return list(plan.items) + [i for i in self._local_items if i.index not in assigned]

    def _place(self, step: int, data: dict[Any, Any]) -> tuple[int, int, dict[Any, int]]:
        """Buffer offsets of every tensor: where staging put it, else copied now."""
        staged = self._staged
        places: dict[Any, int] = {}
        todo = []
        for key, value in data.items():
            if isinstance(value, io.BytesIO):
                continue
            at = _offset_in(staged.base, value) if staged is not None else None
            if at is None:
                todo.append(key)
            else:
                places[key] = at
        used = staged.used if staged is not None else 0
        for key in todo:
            places[key] = used
            used = lay.aligned(used + data[key].numel() * data[key].element_size())
        if staged is not None:
            buffer, target = staged.buffer, self._saver.grow(staged.buffer, max(used, 1))
        else:
            buffer, target = self._saver.reserve(step, used)
        for key in todo:
            _copy_into(target, places[key], data[key])
        return buffer, used, places

    def _hand_off(self, slot: sl.DcpSlot, blob: bytearray) -> None:
        self._saver.drop_from(slot.step)
        sl.hand_off(self._saver.settings.shm_dir, slot, bytes(blob))
        self._pending = None


def _item_pieces(entry: tuple[Any, ...], blob: bytearray) -> list[sl.Piece]:
    if entry[0] == "bytes":
        return [("lit", entry[1], entry[2])]
    _, at, dtype, shape = entry
    out: list[sl.Piece] = []
    for piece in torch_save.image(dtype, shape):
        match piece:
            case zip_image.Literal(data):
                out.append(("lit", len(blob), len(data)))
                blob += data
            case zip_image.Data(nbytes):
                out.append(("buf", at, nbytes))
            case zip_image.Crc():
                out.append(("crc", at, torch.Size(shape).numel() * dtype.itemsize))
    return out


def _offset_in(base: torch.Tensor, t: torch.Tensor) -> int | None:
    """Where ``t`` lies in ``base`` (a staged copy), or None if it is elsewhere or strided."""
    if not t.is_contiguous() or t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        return None
    return int(t.data_ptr() - base.data_ptr())


def _copy_into(base: torch.Tensor, at: int, t: torch.Tensor) -> torch.Tensor:
    nbytes = t.numel() * t.element_size()
    region = base[at : at + nbytes]
    view = region.view(t.dtype).view(t.shape) if nbytes else torch.empty(t.shape, dtype=t.dtype)
    with torch.no_grad():
        view.copy_(t.detach())
    return view


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor's data on this rank: a DTensor's local shard."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _replaced(value: Any, views: Iterator[torch.Tensor]) -> Any:
    """A leaf of the state dict with the next of ``views`` in place of its tensor (of a DTensor's
    local shard); any other leaf stays. (A named tuple's tensors are copied by write_data.)"""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return DTensor.from_local(
            next(views),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return next(views)
    return value
