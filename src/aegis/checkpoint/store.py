"""Persisting a shared-memory slot to disk, and reading a committed copy back (no torch)."""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aegis.checkpoint.layout as lay  # not through the package: it re-exports api
import aegis.checkpoint.safe_pickle as ckpt_safe
from aegis.core.errors import AegisError

CHUNK = 16 * 1024 * 1024


class SlotReplacedError(AegisError):
    """The slot being persisted was dropped or replaced meanwhile (a save went on while the
    store was down): what was read may mix two states, so it is not committed."""

    def __init__(self, step: int) -> None:
        super().__init__(f"checkpoint step {step}: slot replaced while it was persisted")
        self.step = step


class CorruptCheckpointError(AegisError):
    """A checkpoint directory that must not be loaded (torn, uncommitted or bad checksum)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"checkpoint step {step}: {reason}")
        self.step = step
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DiskCopy:
    layout: lay.Layout
    skeleton: Any  # the state, TensorRefs for its tensors (unpickled by safe_pickle)
    data: bytearray


def persist(
    shm: Path,
    ckpt: Path,
    step: int,
    max_write_mb_s: float = 0.0,
    still_handed: Callable[[], bool] | None = None,
) -> Path:
    """Write slot ``step`` as ``step-<step>/`` (manifest, checksums), then the commit marker,
    unless ``still_handed()`` says, after every read of the slot, that it was replaced
    (:class:`SlotReplacedError`; the uncommitted copy is removed)."""
    layout = lay.read_layout(shm, step)
    skeleton = lay.slot_pkl(shm, step).read_bytes()
    ckpt.mkdir(parents=True, exist_ok=True)
    tmp = ckpt / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    crcs = _write_data(
        lay.buffer_path(shm, layout.buffer), tmp / "data.bin", layout, max_write_mb_s
    )
    manifest = json.dumps(
        {
            "format": lay.FORMAT,
            "step": step,
            "layout": layout.to_json(),
            "meta_crc32": zlib.crc32(skeleton),
            "tensor_crc32": crcs,
        }
    ).encode()
    _write_durable(tmp / "meta.pkl", skeleton)
    _write_durable(tmp / "manifest.json", manifest)
    lay.fsync_dir(tmp)
    final = lay.step_dir(ckpt, step)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    lay.fsync_dir(ckpt)
    if still_handed is not None and not still_handed():
        shutil.rmtree(final, ignore_errors=True)
        raise SlotReplacedError(step)
    marker = {"step": step, "manifest_crc32": zlib.crc32(manifest)}
    lay.write_atomic(final / lay.COMMIT, json.dumps(marker).encode(), durable=True)
    return final


def _write_durable(path: Path, data: bytes) -> None:
    with path.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _write_data(source: Path, target: Path, layout: lay.Layout, max_mb_s: float) -> list[int]:
    size = layout.data_bytes
    started = time.monotonic()
    with target.open("wb") as out, lay.mapped(source, size) as view:
        crcs = [zlib.crc32(view[t.offset : t.offset + t.nbytes]) for t in layout.tensors]
        for start in range(0, size, CHUNK):
            out.write(view[start : start + CHUNK])
            if max_mb_s > 0:
                ahead = (start + CHUNK) / (max_mb_s * 1e6) - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)  # rate limit: leave bandwidth to training
        out.flush()
        os.fsync(out.fileno())
    return crcs


def read_committed(ckpt: Path, step: int) -> DiskCopy:
    """The verified content of ``step-<step>/``; raises :class:`CorruptCheckpointError`, or
    :class:`~aegis.checkpoint.safe_pickle.UnsafeCheckpointError` where its state names a
    global not allowed."""
    where = lay.step_dir(ckpt, step)
    try:
        marker = json.loads((where / lay.COMMIT).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpointError(step, "no commit marker (torn or unfinished copy)") from None
    except ValueError:
        raise CorruptCheckpointError(step, "unreadable commit marker") from None
    try:
        manifest_bytes = (where / "manifest.json").read_bytes()
        skeleton = (where / "meta.pkl").read_bytes()
        if zlib.crc32(manifest_bytes) != marker.get("manifest_crc32"):
            raise CorruptCheckpointError(step, "manifest checksum mismatch")
        manifest = json.loads(manifest_bytes)
        if zlib.crc32(skeleton) != manifest["meta_crc32"]:
            raise CorruptCheckpointError(step, "meta.pkl checksum mismatch")
        layout = lay.Layout.from_json(manifest["layout"])
        data = _read_exact(where / "data.bin", layout.data_bytes, step)
        crcs = manifest["tensor_crc32"]
    except (OSError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(step, f"unreadable: {exc}") from None
    if layout.data_bytes == 0 and crcs == []:  # empty tensors only, as older copies wrote it
        crcs = [zlib.crc32(b"")] * len(layout.tensors)
    if not isinstance(crcs, list) or len(crcs) != len(layout.tensors):
        raise CorruptCheckpointError(step, "manifest checksums do not match its tensors")
    view = memoryview(data)
    for number, (t, want) in enumerate(zip(layout.tensors, crcs, strict=True)):
        if zlib.crc32(view[t.offset : t.offset + t.nbytes]) != want:
            view.release()
            raise CorruptCheckpointError(step, f"checksum mismatch in tensor {number} of data.bin")
    view.release()
    try:
        state = ckpt_safe.loads(skeleton)
    except ckpt_safe.UnsafeCheckpointError:
        raise
    except Exception as exc:  # a pickle that matches its checksum and still does not unpickle
        raise CorruptCheckpointError(step, f"unreadable meta.pkl: {type(exc).__name__}") from None
    return DiskCopy(layout, state, data)


def _read_exact(path: Path, size: int, step: int) -> bytearray:
    if path.stat().st_size != size:
        raise CorruptCheckpointError(step, f"data.bin has {path.stat().st_size} bytes, not {size}")
    data = bytearray(size)
    with path.open("rb", buffering=0) as src:
        view = memoryview(data)
        got = 0
        while got < size:
            n = src.readinto(view[got:])
            if not n:
                raise CorruptCheckpointError(step, "data.bin shorter than its manifest")
            got += n
        view.release()
    return data


def clean_tmp(ckpt: Path) -> None:
    """Remove copies left unfinished by a daemon that died mid-write."""
    if ckpt.is_dir():
        for entry in ckpt.iterdir():
            if entry.name.startswith(".tmp-step-"):
                shutil.rmtree(entry, ignore_errors=True)


def discard_torn(ckpt: Path, step: int) -> None:
    """After a failed persist: its unfinished copies go (they hold the space a full disk
    needs); a ``step-<step>/`` without its commit marker is never loaded anyway."""
    clean_tmp(ckpt)
    where = lay.step_dir(ckpt, step)
    if where.is_dir() and not (where / lay.COMMIT).exists():
        shutil.rmtree(where, ignore_errors=True)


def prune(ckpt: Path, keep: int, committed: int | None = None, hold: int | None = None) -> int:
    """Keep the newest ``keep`` step directories (at most ``committed``, the step just
    committed), and those the job may resume from (``hold``: see :func:`to_prune`); how many
    are left."""
    steps = lay.disk_steps(ckpt)
    gone = to_prune(steps, keep, committed, hold)
    for step in gone:
        shutil.rmtree(lay.step_dir(ckpt, step), ignore_errors=True)
    return len(steps) - len(gone)


def to_prune(
    steps: list[int], keep: int, committed: int | None, hold: int | None = None
) -> list[int]:
    """Which of ``steps`` (ascending) go: those above ``committed``, an abandoned timeline (a
    restart rewound to an earlier step; within one timeline commits only go up), then the
    oldest beyond the newest ``keep``, but not those the job may resume from (``hold``, the
    job's committed step, and newer ones: ``layout.held``), though this pod is ahead (another
    pod's store may be down). Counting the abandoned ones among the kept deleted the steps of
    the timeline the job resumed on; pruning by ``keep`` alone deleted the step the job resumed
    from when this pod was ``keep`` commits ahead of the job."""
    above = [s for s in steps if committed is not None and s > committed]
    rest = [s for s in steps if s not in above]
    kept = lay.held(rest, hold)
    return [s for s in rest[: max(len(rest) - keep, 0)] if s not in kept] + above
