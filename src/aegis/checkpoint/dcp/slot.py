"""A DCP checkpoint slot in shared memory, and how the saver daemon persists it (no torch).

A DCP slot uses the same files as any slot (:mod:`aegis.checkpoint.layout`): its rank's data in
``buf-<n>``, ``slot-<step>.pkl`` holding literal bytes (zip headers of ``torch.save`` records,
pickled objects, the pickled DCP metadata on the coordinator, the reader's index), and
``slot-<step>.json`` (the hand-off) with a ``"dcp"`` section: the checkpoint directory, every
file to write there as a list of pieces (``["lit", at, n]`` bytes of the ``.pkl`` blob,
``["buf", at, n]`` bytes of the buffer, ``["crc", at, n]`` the CRC32 of bytes of the buffer), the
pickled DCP metadata (coordinator only) and the files of the other ranks that must be on disk
before it is written. The ``.metadata`` file, written last and atomically by the coordinator's
daemon once every rank's files are there, is what makes the directory a DCP checkpoint. It has a
sidecar, ``.metadata.crc32``: the CRC32 of the whole file (the reader checks it; nothing else
would see a flipped bit that still unpickles). The data files are checked by their items' own
zip CRCs (a whole-file CRC32 of them added a third to every persist: ``benchmarks/dcp_crc.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegis.checkpoint import layout as lay
from aegis.checkpoint.store import SlotReplacedError
from aegis.core.errors import AegisError

METADATA = ".metadata"
CRC_SUFFIX = ".crc32"  # beside each file: the CRC32 of the whole file, 8 hex digits and \n
CHUNK = 16 * 1024 * 1024

Piece = tuple[str, int, int]  # ("lit" | "buf" | "crc", offset, length)


class AbandonedStepError(AegisError, FileNotFoundError):
    """The coordinator's slot was dropped: the other ranks' files never came (the daemon goes
    on with the next slot; the step is never committed, so no rank resumes from it)."""


@dataclass(frozen=True, slots=True)
class FileSpec:
    name: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class DcpSlot:
    step: int
    buffer: int
    data_bytes: int
    directory: Path
    files: tuple[FileSpec, ...]
    index: tuple[int, int]  # the reader's pickled index, in the blob
    metadata: tuple[int, int] | None = None  # the pickled DCP Metadata (coordinator)
    wait_for: tuple[str, ...] = ()
    incarnation: int = lay.UNKNOWN  # the restart count of the training that saved it

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "buffer": self.buffer,
            "data_bytes": self.data_bytes,
            "tensors": [],
            "incarnation": self.incarnation,
            "dcp": {
                "dir": str(self.directory),
                "files": [
                    {"name": f.name, "pieces": [list(p) for p in f.pieces]} for f in self.files
                ],
                "index": list(self.index),
                "metadata": None if self.metadata is None else list(self.metadata),
                "wait_for": list(self.wait_for),
            },
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> DcpSlot:
        d = data["dcp"]
        meta = d.get("metadata")
        return DcpSlot(
            step=int(data["step"]),
            buffer=int(data["buffer"]),
            data_bytes=int(data["data_bytes"]),
            directory=Path(d["dir"]),
            files=tuple(
                FileSpec(str(f["name"]), tuple((str(k), int(a), int(n)) for k, a, n in f["pieces"]))
                for f in d["files"]
            ),
            index=(int(d["index"][0]), int(d["index"][1])),
            metadata=None if meta is None else (int(meta[0]), int(meta[1])),
            wait_for=tuple(str(n) for n in d["wait_for"]),
            incarnation=lay.incarnation_of(data.get("incarnation")),
        )


def read(shm: Path, step: int) -> DcpSlot | None:
    """The DCP slot of ``step``, or None when that slot is not a DCP one (or is gone)."""
    try:
        data = json.loads(lay.slot_json(shm, step).read_bytes())
    except (FileNotFoundError, ValueError):
        return None
    return DcpSlot.from_json(data) if isinstance(data, dict) and "dcp" in data else None


def hand_off(shm: Path, slot: DcpSlot, blob: bytes) -> None:
    """Write the blob, then the slot's json (the daemon takes the slot once that is there)."""
    lay.write_atomic(lay.slot_pkl(shm, slot.step), blob, durable=False)
    lay.write_atomic(lay.slot_json(shm, slot.step), json.dumps(slot.to_json()).encode(),
                     durable=False)  # fmt: skip


def persist(
    shm: Path,
    slot: DcpSlot,
    keep: int,
    *,
    wait_s: float = 600.0,
    still_handed: Callable[[], bool] | None = None,
    hold: int | None = None,
) -> Path:
    """Write this rank's files of ``slot`` into its directory (each fsync'd, renamed into place),
    then, on the coordinator, wait for the other ranks' files and write ``.metadata`` last
    (:class:`AbandonedStepError` when they are not there within ``wait_s``). A file goes into
    place, and ``.metadata`` is written, only while ``still_handed()`` says the slot was not
    replaced since it was read (:class:`SlotReplacedError`, nothing of it left): a save that
    went on meanwhile may have overwritten the buffer, and the coordinator takes any file
    there as this save's. ``hold``: see :func:`prune`."""
    blob = lay.slot_pkl(shm, slot.step).read_bytes()
    where = slot.directory
    where.mkdir(parents=True, exist_ok=True)
    with lay.mapped(lay.buffer_path(shm, slot.buffer), slot.data_bytes) as data:
        for spec in slot.files:
            _put(where, spec.name, spec.pieces, (blob, data), slot.step, still_handed, False)
    lay.fsync_dir(where)
    if slot.metadata is None:
        return where
    try:
        _wait_for(where, slot.wait_for, wait_s, lambda: _check_handed(slot.step, still_handed))
    except TimeoutError as exc:  # a peer's copy is gone (its pod replaced): never complete
        for path in (lay.slot_json(shm, slot.step), lay.slot_pkl(shm, slot.step)):
            path.unlink(missing_ok=True)
        raise AbandonedStepError(f"step {slot.step} abandoned, not committed: {exc}") from None
    at, n = slot.metadata
    _put(where, METADATA, [("lit", at, n)], (blob, memoryview(b"")), slot.step, still_handed,
         True)  # fmt: skip
    lay.fsync_dir(where)
    prune(where.parent, keep, hold)
    return where


def _tmp(where: Path, name: str) -> Path:
    return where / f".{name}.tmp-{os.getpid()}"


def _put(where: Path, name: str, pieces: Sequence[Piece], sources: tuple[bytes, memoryview],
         step: int, still_handed: Callable[[], bool] | None, sidecar: bool) -> None:  # fmt: skip
    """Write file ``name`` (and its CRC32 sidecar) beside their places, and rename them into
    place (the sidecar first: a reader finds it whenever it finds the file) unless the slot
    was replaced since it was read (then neither is left)."""
    crc = _write_file(where, name, pieces, *sources, whole=sidecar)
    written = [name]
    if crc is not None:
        written.insert(0, name + CRC_SUFFIX)
        with _tmp(where, written[0]).open("wb") as out:
            out.write(f"{crc:08x}\n".encode())
            out.flush()
            os.fsync(out.fileno())
    try:
        _check_handed(step, still_handed)
    except SlotReplacedError:
        for each in written:
            _tmp(where, each).unlink(missing_ok=True)
        raise
    for each in written:
        _tmp(where, each).rename(where / each)


def _write_file(where: Path, name: str, pieces: Sequence[Piece], blob: bytes,
                data: memoryview, *, whole: bool) -> int | None:  # fmt: skip
    """Write the file beside its place (``_put`` puts it there); its CRC32 when ``whole``."""
    tmp = _tmp(where, name)
    crcs: dict[tuple[int, int], bytes] = {}
    crc = 0
    with tmp.open("wb") as out:
        for kind, at, n in pieces:
            if kind == "lit":
                parts: Sequence[bytes | memoryview] = [blob[at : at + n]]
            elif kind == "buf":
                parts = [data[i : min(i + CHUNK, at + n)] for i in range(at, at + n, CHUNK)]
            elif kind == "crc":
                if (at, n) not in crcs:
                    crcs[at, n] = zlib.crc32(data[at : at + n]).to_bytes(4, "little")
                parts = [crcs[at, n]]
            else:
                raise ValueError(f"unknown piece {kind!r} in the slot of {where / name}")
            for part in parts:
                out.write(part)
                if whole:
                    crc = zlib.crc32(part, crc)
        out.flush()
        os.fsync(out.fileno())
    return crc if whole else None


def _check_handed(step: int, still_handed: Callable[[], bool] | None) -> None:
    if still_handed is not None and not still_handed():
        raise SlotReplacedError(step)


def _wait_for(where: Path, names: Sequence[str], wait_s: float, check: Callable[[], None]) -> None:
    """Until every file is there; ``check`` raises to stop waiting (the slot was replaced: after
    a restart the step is saved anew, under other names, and this save will never complete)."""
    deadline = time.monotonic() + wait_s
    while missing := [n for n in names if not (where / n).exists()]:
        check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{where}: other ranks' files {missing} not written in {wait_s} s")
        time.sleep(0.02)


def steps(root: Path) -> list[int]:
    """Steps with a complete DCP checkpoint (``step-<N>/.metadata``) under ``root``, ascending."""
    return [s for s in lay.disk_steps(root) if (lay.step_dir(root, s) / METADATA).exists()]


def prune(root: Path, keep: int, hold: int | None = None) -> None:
    """Keep the newest ``keep`` complete checkpoints under ``root`` (and what is newer), those
    the job may resume from (``hold``: ``layout.held``), and an incomplete one above ``hold``:
    a save in progress, its peers' files still coming in (after a restart rewound to the job's
    step, below the abandoned timeline's complete steps)."""
    complete = steps(root)
    if len(complete) <= keep:
        return
    oldest_kept, kept = complete[-keep], lay.held(complete, hold)
    for step in lay.disk_steps(root):
        in_progress = hold is not None and step > hold and step not in complete
        if step < oldest_kept and step not in kept and not in_progress:
            shutil.rmtree(lay.step_dir(root, step), ignore_errors=True)


def default_root(env: dict[str, str]) -> Path | None:
    """Where DCP checkpoints go: ``AEGIS_DCP_DIR``, else ``dcp/`` in the job's checkpoint
    directory (under the agent ``AEGIS_CKPT_DIR`` is ``<job dir>/<pod>``: one DCP checkpoint
    holds every rank's files, so it lives beside the pods' directories), else None."""
    if env.get("AEGIS_DCP_DIR"):
        return Path(env["AEGIS_DCP_DIR"])
    ckpt = env.get("AEGIS_CKPT_DIR")
    if not ckpt:
        return None
    path = Path(ckpt)
    pod = env.get("AEGIS_POD")
    return (path.parent if pod and path.name == pod else path) / "dcp"


def next_step(shm: Path, root: Path | None, resume_step: int | None) -> int:
    """The step a save without a checkpoint id makes: one past the newest this pod knows of
    (in shared memory or on disk), or past the job's resume step after a restart."""
    known = lay.slot_steps(shm) + (lay.disk_steps(root) if root is not None else [])
    if resume_step is not None:
        known = [s for s in known if s <= resume_step] + [resume_step]
    return max(known, default=0) + 1
