"""Names and formats shared by the training side, the saver daemon and the loaders (no torch).

Shared-memory directory (owned by the agent, survives a restart of the training process):

- ``buf-0``, ``buf-1``: two data buffers used in turn; the newest committed slot's buffer is never
  written, so a restarted process can always read it back;
- ``slot-<step>.pkl``: the pickled skeleton of the state (tensors replaced by :class:`TensorRef`);
- ``slot-<step>.json``: the layout (buffer, offsets, dtypes, shapes); its rename into place is the
  hand-off to the daemon;
- ``committed-<step>``: written by the daemon once the step is durable on disk;
- ``commits.jsonl``: one ``{"step", "path", "ts"}`` line per commit (the agent tails it).

A torch distributed checkpoint's slot (:mod:`aegis.checkpoint.dcp.slot`) uses the same names and
buffers; its ``slot-<step>.json`` has a ``"dcp"`` section and is persisted in DCP's own format.

Checkpoint directory: ``step-<N>/`` holding ``data.bin``, ``meta.pkl``, ``manifest.json`` (layout
plus CRC32 of every tensor and of ``meta.pkl``) and the commit marker ``COMMIT`` (written last,
fsync'd, atomic rename). A directory without ``COMMIT`` or with a bad checksum is never loaded.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ALIGN = 64
FORMAT = 1
COMMIT = "COMMIT"
COMMITS_LOG = "commits.jsonl"
_SLOT = re.compile(r"^slot-(\d+)\.json$")
_STEP = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Placeholder of the tensor number ``index`` in a pickled skeleton."""

    index: int


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    step: int
    buffer: int
    data_bytes: int
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Layout:
        return Layout(
            step=int(data["step"]),
            buffer=int(data["buffer"]),
            data_bytes=int(data["data_bytes"]),
            tensors=tuple(
                TensorEntry(str(t["dtype"]), tuple(int(s) for s in t["shape"]), int(t["offset"]),
                            int(t["nbytes"]))
                for t in data["tensors"]
            ),
        )  # fmt: skip


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def buffer_path(shm: Path, buffer: int) -> Path:
    return shm / f"buf-{buffer}"


def slot_json(shm: Path, step: int) -> Path:
    return shm / f"slot-{step}.json"


def slot_pkl(shm: Path, step: int) -> Path:
    return shm / f"slot-{step}.pkl"


def committed_marker(shm: Path, step: int) -> Path:
    return shm / f"committed-{step}"


def step_dir(ckpt: Path, step: int) -> Path:
    return ckpt / f"step-{step}"


def slot_steps(shm: Path) -> list[int]:
    """Steps with a handed-off slot in shared memory, ascending."""
    return _numbered(shm, _SLOT)


def pending(shm: Path) -> list[int]:
    """Steps handed off and not yet committed (the daemon's work still to do), ascending."""
    return [s for s in slot_steps(shm) if not committed_marker(shm, s).exists()]


def disk_steps(ckpt: Path) -> list[int]:
    """Steps with a ``step-<N>`` directory under ``ckpt``, complete or not, ascending."""
    return _numbered(ckpt, _STEP)


def _numbered(directory: Path, name: re.Pattern[str]) -> list[int]:
    """The numbers in the names of ``directory`` that match ``name``, ascending (none without
    the directory)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := name.match(n)))


def read_layout(shm: Path, step: int) -> Layout:
    return Layout.from_json(json.loads(slot_json(shm, step).read_text()))


def write_atomic(path: Path, data: bytes, *, durable: bool) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as out:
        out.write(data)
        if durable:
            out.flush()
            os.fsync(out.fileno())
    tmp.rename(path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
