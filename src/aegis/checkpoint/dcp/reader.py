"""``Reader``: DCP's ``FileSystemReader`` that restores from the pod's shared memory first.

``read_metadata`` decides, on every rank alike (two small collectives on the default group when
one is set up), which checkpoint to load: with no ``checkpoint_id``, the newest step that every
rank holds in shared memory, else the newest complete one on disk whose files pass their CRCs
(each rank checks a share of them; a corrupt one is skipped, with a warning, for the one
before); a step number names one; a directory is read as DCP's ``FileSystemReader`` reads it.
``read_data`` copies each item this rank holds in shared memory straight into its destination
(one ``preadv`` from the buffer file), and reads the others (another rank's items, resharding)
from the step's files, waiting for the daemons to write them if the save was just made.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dmd
from torch.distributed.checkpoint import planner as dpl
from torch.futures import Future

import aegis.checkpoint.dcp.slot as sl  # (by path: the dcp package imports this module lazily)
from aegis.checkpoint import api, collective, shm_read
from aegis.checkpoint import layout as lay
from aegis.checkpoint.dcp.writer import checked_id, parse_step
from aegis.core.errors import AegisError

log = logging.getLogger(__name__)

Index = dict[dmd.MetadataIndex, tuple[Any, ...]]


class CheckpointNotFoundError(AegisError, FileNotFoundError):
    """No checkpoint to load (none in shared memory, none complete and valid on disk)."""


@dataclass(frozen=True, slots=True)
class _Local:
    """This rank's shared-memory copy of the chosen step."""

    slot: sl.DcpSlot
    index: Index


class Reader(filesystem.FileSystemReader):
    def __init__(self, root: str | os.PathLike[str] | None = None,
                 environ: dict[str, str] | None = None, wait_s: float = 600.0) -> None:  # fmt: skip
        env = dict(os.environ if environ is None else environ)
        self._settings = api.SaverSettings.from_env(env)
        self._root = Path(root) if root is not None else sl.default_root(env)
        super().__init__(self._root or ".")
        self._explicit: Any = None
        self._local: _Local | None = None
        self._wait_s = wait_s
        self.step: int | None = None  # the step loaded, once read_metadata chose it
        self.source: str | None = None  # "shm" or "disk"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._explicit = checked_id(checkpoint_id)
        self._local = None
        super().reset(None if parse_step(checkpoint_id) is not None else checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return checkpoint_id is None or parse_step(checkpoint_id) is not None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dmd.Metadata:
        if self._explicit is not None and parse_step(self._explicit) is None:
            return super().read_metadata(*args, **kwargs)  # a directory: DCP's own reader
        if kwargs.get("rank") is not None:  # DCP's retry for rank-local metadata: Aegis has none
            raise CheckpointNotFoundError("no rank-local metadata in Aegis checkpoints")
        shm = self._settings.shm_dir
        mine = self._shm_steps()
        disk = sl.steps(self._root) if self._root is not None else []
        limit = self._settings.resume_step
        disk = [s for s in disk if limit is None or s <= limit]
        gathered = collective.all_gather((mine, disk))
        wanted = parse_step(self._explicit)
        in_shm = set.intersection(*(set(m) for m, _ in gathered))
        candidates = sorted(in_shm) if wanted is None else [s for s in in_shm if s == wanted]
        if candidates:
            step = candidates[-1]
            rank0 = collective.rank() == 0
            meta_bytes = collective.broadcast(_slot_metadata(shm, step) if rank0 else None)
            meta = pickle.loads(meta_bytes)
            self.source = "shm"
        else:
            on_disk = gathered[0][1] if wanted is None else [wanted]
            step, meta = self._newest_valid_on_disk(on_disk)
            self.source = "disk"
        self.step = step
        own = sl.read(shm, step)  # this rank's items come from shared memory wherever it has them
        if own is not None:
            blob = lay.slot_pkl(shm, step).read_bytes()
            at, n = own.index
            self._local = _Local(own, pickle.loads(blob[at : at + n]))
        self.path = own.directory if own is not None else self._step_dir(step)
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dmd.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        log.info("DCP checkpoint step %s: loading from %s", step, self.source)
        loaded: dmd.Metadata = meta
        return loaded

    def read_data(self, plan: dpl.LoadPlan, planner: dpl.LoadPlanner) -> Future[None]:
        local = self._local
        here = [] if local is None else [r for r in plan.items if r.storage_index in local.index]
        taken = {id(r) for r in here}
        elsewhere = [r for r in plan.items if id(r) not in taken]
        if here and local is not None:
            _read_shm(self._settings.shm_dir, local, here, planner)
        if elsewhere:
            self._wait_for_files(elsewhere)
            return super().read_data(dpl.LoadPlan(elsewhere), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -- choosing a step -------------------------------------------------------------------

    def _shm_steps(self) -> list[int]:
        shm, limit = self._settings.shm_dir, self._settings.resume_step
        steps = []
        for step in lay.slot_steps(shm):
            s = sl.read(shm, step)
            if s is None or (limit is not None and step > limit):
                continue
            if collective.rank() == 0 and s.metadata is None:
                continue  # the coordinator's slot is whole only with the metadata
            steps.append(step)
        return steps

    def _step_dir(self, step: int) -> Path:
        if self._root is None:
            raise CheckpointNotFoundError("aegis.checkpoint.dcp.Reader: no checkpoint directory")
        return self._root / f"step-{step}"

    def _newest_valid_on_disk(self, steps: list[int]) -> tuple[int, dmd.Metadata]:
        for step in reversed(steps):
            meta, problem = _read_step(self._step_dir(step))
            # every rank gets here, step by step
            problems = [p for p in collective.all_gather(problem) if p]
            if not problems and meta is not None:
                return step, meta
            log.warning("DCP checkpoint step %s skipped: %s", step, "; ".join(problems))
        raise CheckpointNotFoundError(f"no valid DCP checkpoint under {self._root}")

    def _wait_for_files(self, items: list[dpl.ReadItem]) -> None:
        """The save may have just been made: its other ranks' files come from their daemons."""
        names = {self.storage_data[r.storage_index].relative_path for r in items}
        deadline = time.monotonic() + self._wait_s
        while missing := [n for n in names if not (Path(self.path) / n).exists()]:
            if time.monotonic() > deadline:
                raise CheckpointNotFoundError(f"{self.path}: {missing} not written")
            time.sleep(0.01)


def _read_shm(shm: Path, local: _Local, items: list[dpl.ReadItem],
              planner: dpl.LoadPlanner) -> None:  # fmt: skip
    fd = os.open(lay.buffer_path(shm, local.slot.buffer), os.O_RDONLY)
    blob: bytes | None = None
    mapped: torch.Tensor | None = None
    jobs: list[tuple[int, torch.Tensor]] = []  # read at once, over threads
    done: list[tuple[dpl.ReadItem, torch.Tensor]] = []
    try:
        for req in items:
            entry = local.index[req.storage_index]
            if entry[0] == "bytes":
                if blob is None:
                    blob = lay.slot_pkl(shm, local.slot.step).read_bytes()
                _, at, n = entry
                planner.load_bytes(req, io.BytesIO(blob[at : at + n]))
                continue
            _, at, dtype, shape = entry
            target = planner.resolve_tensor(req).detach()
            whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == shape
            if whole and target.is_contiguous() and target.dtype == dtype and target.is_cpu:
                jobs.append((at, target))  # the common case: one copy, straight into place
                done.append((req, target))
                continue
            if mapped is None:  # a part of the item (resharding), or a target elsewhere
                mapped = _map(lay.buffer_path(shm, local.slot.buffer), local.slot.data_bytes)
            n = torch.Size(shape).numel() * dtype.itemsize
            source = mapped[at : at + n].view(dtype).view(shape)
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths,
                                                      strict=True)):  # fmt: skip
                source = source.narrow(dim, start, length)
            target.copy_(source)
            planner.commit_tensor(req, target)
        shm_read.read_into(fd, jobs)
        for req, target in done:
            planner.commit_tensor(req, target)
    finally:
        os.close(fd)


def _map(path: Path, size: int) -> torch.Tensor:
    storage: Any = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(size, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _slot_metadata(shm: Path, step: int) -> bytes | None:
    s = sl.read(shm, step)
    if s is None or s.metadata is None:
        return None
    at, n = s.metadata
    return lay.slot_pkl(shm, step).read_bytes()[at : at + n]


def _read_step(where: Path) -> tuple[dmd.Metadata | None, str | None]:
    """The step's metadata, and what is wrong with it or with this rank's share of its files.

    Any error reading or checking them makes the step a bad one, never the load's failure:
    unpickling or unzipping a damaged file can raise nearly any exception.
    """
    try:
        if problem := _whole_file_problem(where / sl.METADATA)[0]:
            return None, problem
        with (where / sl.METADATA).open("rb") as src:
            meta = pickle.load(src)
    except Exception as exc:
        return None, f"unreadable metadata: {type(exc).__name__}: {exc}"
    if not isinstance(meta, dmd.Metadata):
        return None, f"unreadable metadata: a {type(meta).__name__}, not DCP metadata"
    try:
        return meta, _check_share(where, meta)
    except Exception as exc:
        return None, f"metadata that does not fit its files: {type(exc).__name__}: {exc}"


def _check_share(where: Path, meta: dmd.Metadata) -> str | None:
    """Check the CRCs of this rank's share of the files (file i: rank i mod world)."""
    by_file: dict[str, list[tuple[dmd.MetadataIndex, filesystem._StorageInfo]]] = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    rank, world = collective.rank(), collective.world()
    for number, name in enumerate(sorted(by_file)):
        if number % world != rank:
            continue
        try:
            problem, whole = _whole_file_problem(where / name)
            if problem or whole:  # its bytes as written (the items' own check: one read less)
                return problem
            with (where / name).open("rb") as src:
                for index, info in by_file[name]:
                    src.seek(info.offset)
                    chunk = src.read(info.length)
                    if len(chunk) != info.length:
                        return f"{name} is shorter than its metadata says"
                    if problem := _check_chunk(chunk, _is_tensor(meta, index)):
                        return f"{name}: {problem}"
        except Exception as exc:
            return f"{name}: {type(exc).__name__}: {exc}"
    return None


def _whole_file_problem(path: Path) -> tuple[str | None, bool]:
    """What the CRC32 of the whole file says is wrong with it, where the writer left one beside
    it, and whether it was checked (checkpoints written before have none: only their items are
    checked)."""
    try:
        expected = path.with_name(path.name + sl.CRC_SUFFIX).read_bytes()
    except FileNotFoundError:
        return None, False
    crc = 0
    with path.open("rb") as src:
        while chunk := src.read(sl.CHUNK):
            crc = zlib.crc32(chunk, crc)
    if expected != f"{crc:08x}\n".encode():
        return f"{path.name}: CRC32 {crc:08x}, written as {expected[:16]!r}", True
    return None, True


def _is_tensor(meta: dmd.Metadata, index: dmd.MetadataIndex) -> bool:
    return isinstance(meta.state_dict_metadata.get(index.fqn), dmd.TensorStorageMetadata)


def _check_chunk(chunk: bytes, tensor: bool) -> str | None:
    """What is wrong with one item's bytes: a tensor is a ``torch.save`` zip, whose CRCs must
    match; other items are the bytes DCP was given, a zip too unless they came as a stream."""
    if chunk[:4] != b"PK\x03\x04":
        return "not a torch.save archive (no zip signature)" if tensor else None
    archive = zipfile.ZipFile(io.BytesIO(chunk))
    for member in archive.infolist():  # (zipfile reads a stored member by one size, torch by both)
        if member.compress_type == zipfile.ZIP_STORED and member.compress_size != member.file_size:
            return f"{member.filename} is stored with two sizes"
    bad = archive.testzip()
    return f"checksum mismatch in {bad}" if bad is not None else None
