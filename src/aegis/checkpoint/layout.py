"""Names and formats shared by the training side, the saver daemon and the loaders (no torch).

Shared-memory directory (owned by the agent, survives a restart of the training process):

- ``buf-0``, ``buf-1``: two data buffers used in turn; the newest committed slot's buffer is never
  written, so a restarted process can always read it back;
- ``slot-<step>.pkl``: the pickled skeleton of the state (tensors replaced by :class:`TensorRef`);
- ``slot-<step>.json``: the layout (buffer, offsets, dtypes, shapes) and the incarnation of the
  training that saved it (its ``AEGIS_RESTART_COUNT``; -1 where not known); its rename into
  place is the hand-off to the daemon;
- ``committed-<step>``: written by the daemon once the step is durable on disk;
- ``commits.jsonl``: one ``{"step", "path", "ts", "incarnation"}`` line per commit (the agent
  tails it; the incarnation, the slot's, lets it tell a commit of a timeline a restart
  abandoned from one of the current timeline);
- ``hold-from``: the job's committed step, as the master tells it (the agent writes it): the
  daemon prunes neither it nor the newest steps after it (:func:`held`).

A pod whose command starts several ranks (``torchrun --nproc-per-node N``: ``LOCAL_WORLD_SIZE``
over 1) gives each its own slots: local rank ``k`` saves into ``local-<k>/`` (the same names
inside, and ``<checkpoint directory>/local-<k>/`` on disk) and writes ``local-world-size``
beside; the daemon persists every ``local-<k>/`` on its own, and a step is the pod's commit (a
line of the pod's ``commits.jsonl``) once every local rank committed it (:func:`pod_committed`).

A torch distributed checkpoint's slot (:mod:`aegis.checkpoint.dcp.slot`) uses the same names and
buffers; its ``slot-<step>.json`` has a ``"dcp"`` section and is persisted in DCP's own format.

Checkpoint directory: ``step-<N>/`` holding ``data.bin``, ``meta.pkl``, ``manifest.json`` (layout
plus CRC32 of every tensor and of ``meta.pkl``) and the commit marker ``COMMIT`` (written last,
fsync'd, atomic rename). A directory without ``COMMIT`` or with a bad checksum is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ALIGN = 64
FORMAT = 1
COMMIT = "COMMIT"
COMMITS_LOG = "commits.jsonl"
RESTART_COUNT_VAR = "AEGIS_RESTART_COUNT"  # = aegis.agent.incarnation.RESTART_COUNT_VAR
UNKNOWN = -1  # the incarnation of a slot or commit that does not say it (an older one)
LOCAL_WORLD = "local-world-size"
_SLOT = re.compile(r"slot-([0-9]+)\.json")  # (matched whole: fullmatch)
_LOCAL = re.compile(r"local-([0-9]+)")
_STEP = re.compile(r"step-([0-9]+)")


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Placeholder of the tensor number ``index`` in a pickled skeleton."""

    index: int

    def __reduce__(self) -> tuple[type[TensorRef], tuple[int]]:
        # one call each way: a 4x quicker pickle than the slots' __getstate__/__setstate__,
        # which a skeleton of many small tensors spent most of its time in (skeletons pickled
        # that way still load: the generated __setstate__ stays)
        return TensorRef, (self.index,)


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
    incarnation: int = UNKNOWN  # the restart count of the training that saved it

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
            incarnation=incarnation_of(data.get("incarnation")),
        )  # fmt: skip


def incarnation_of(value: object) -> int:
    """An incarnation as a slot or a commit line says it (a restart count, 0 or more); anything
    else (absent, a string, a bool, a negative or fractional number) is :data:`UNKNOWN`."""
    return value if type(value) is int and value >= 0 else UNKNOWN


def incarnation_in(env: Mapping[str, str]) -> int:
    """The incarnation of the training process whose environment is ``env``: the restart count
    the agent gave it, :data:`UNKNOWN` without one (not under an agent) or when malformed."""
    text = env.get(RESTART_COUNT_VAR, "")
    return int(text) if text.isascii() and text.isdigit() else UNKNOWN


def slot_incarnation(shm: Path, step: int) -> int:
    """The incarnation that saved the slot of ``step`` (:data:`UNKNOWN`: it does not say, or
    the slot is gone or unreadable)."""
    try:
        data = json.loads(slot_json(shm, step).read_bytes())
    except (OSError, ValueError):
        return UNKNOWN
    return incarnation_of(data.get("incarnation")) if isinstance(data, dict) else UNKNOWN


def pod_incarnation(stamps: Iterable[int]) -> int:
    """The incarnation of a pod's commit that every local rank committed: the oldest of theirs
    (:data:`UNKNOWN` if any rank's is not known, or none is given)."""
    return min(stamps, default=UNKNOWN)


def newest_incarnation(shm: Path) -> int:
    """The newest incarnation any slot or commit line of the pod's shared memory says
    (:data:`UNKNOWN`: none says one). Left by an agent that died with its container, it is where
    the next agent's count goes on from: counted from 0 again, that agent would take the
    predecessor's timeline for its own (:mod:`aegis.agent.commit_rule`)."""
    stamps = [UNKNOWN]
    for where in slot_dirs(shm):
        stamps += (slot_incarnation(where, step) for step in slot_steps(where))
        try:
            lines = (where / COMMITS_LOG).read_bytes().splitlines()
        except OSError:
            continue
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    stamps.append(incarnation_of(record.get("incarnation")))
    return max(stamps)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@contextlib.contextmanager
def mapped(path: Path, size: int) -> Iterator[memoryview]:
    """The first ``size`` bytes of ``path`` (a slot's buffer), mapped read-only; nothing is
    opened for 0 bytes."""
    if size == 0:
        yield memoryview(b"")
        return
    with path.open("rb") as src, mmap.mmap(src.fileno(), size, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)
        try:
            yield view
        finally:
            view.release()


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


def committed(shm: Path) -> list[int]:
    """Steps with a slot the daemon has committed, ascending."""
    return [s for s in slot_steps(shm) if committed_marker(shm, s).exists()]


def local_rank_of(env: Mapping[str, str]) -> int | None:
    """The local rank whose own slots a process uses: ``LOCAL_RANK`` where the pod runs more
    than one rank (``LOCAL_WORLD_SIZE`` over 1); None where it runs one (the pod's directory)."""
    try:
        if int(env.get("LOCAL_WORLD_SIZE", "1")) > 1:
            return int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        return None
    return None


def local_dir(base: Path, local_rank: int) -> Path:
    return base / f"local-{local_rank}"


def local_dirs(shm: Path) -> list[Path]:
    """The local ranks' slot directories in a pod's shared memory, by local rank."""
    return [local_dir(shm, k) for k in _numbered(shm, _LOCAL)]


def slot_dirs(shm: Path) -> list[Path]:
    """Every directory of the pod's shared memory that holds slots: its own, then the local
    ranks'."""
    return [shm, *local_dirs(shm)]


def pending_anywhere(shm: Path) -> list[int]:
    """Steps handed off and not yet committed in any slot directory of the pod, ascending."""
    return sorted({s for d in slot_dirs(shm) for s in pending(d)})


def expected_local_ranks(shm: Path) -> int:
    """How many local ranks the pod's command runs, as they wrote it (0: not said)."""
    try:
        return int((shm / LOCAL_WORLD).read_text())
    except (OSError, ValueError):
        return 0


def pod_committed(step: int, expected: int, committed: Iterable[Iterable[int]]) -> bool:
    """Whether ``step`` is committed for the pod: every one of the ``expected`` local ranks
    (each entry of ``committed`` the steps one local rank has committed) has committed it."""
    per_rank = [set(steps) for steps in committed]
    return expected > 0 and len(per_rank) >= expected and all(step in c for c in per_rank)


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
    return sorted(n for n in (number_in(name, entry) for entry in names) if n is not None)


def number_in(name: re.Pattern[str], entry: str) -> int | None:
    """The number in ``entry`` if it is ``name`` with the number written as Aegis writes it:
    ``slot-05.json`` is not step 5's slot (``slot-5.json``, which code opens by the number)."""
    m = name.fullmatch(entry)
    return int(m.group(1)) if m and str(int(m.group(1))) == m.group(1) else None


HOLD_FROM = "hold-from"
# How many of a pod's newest commits the master remembers (``master.safe_points.KEPT_STEPS``,
# a test keeps them equal): the job's committed step can only move to one of those, so from the
# held step on a saver keeps the held step and, of the newer ones, these newest (not every one:
# a store down for the rest of the run would fill the others' disks).
HELD_NEWEST = 16


def held(steps: list[int], hold: int | None) -> set[int]:
    """Of ``steps`` (ascending), those the job may still resume from: ``hold`` and, of the newest
    :data:`HELD_NEWEST`, those above it (none when nothing is held)."""
    if hold is None:
        return set()
    return {s for s in steps if s == hold} | {s for s in steps[-HELD_NEWEST:] if s > hold}


def hold_from(shm: Path, step: int) -> None:
    """The job's committed step is ``step``: the daemon of ``shm`` prunes neither it nor the
    newest steps after it (:func:`held`: the job may resume from them)."""
    write_atomic(shm / HOLD_FROM, str(step).encode(), durable=False)


def held_from(shm: Path) -> int | None:
    """The step :func:`hold_from` wrote; None when none was (or it does not read as one)."""
    try:
        text = (shm / HOLD_FROM).read_text()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isascii() and text.isdigit() else None


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


def allocate(path: Path, size: int) -> None:
    """Give ``path`` (created if missing) ``size`` bytes of real space before it is mapped: a
    write through a mapping past a full filesystem's end is a SIGBUS, not an error. On failure
    (ENOSPC) the file is left as it was, or removed if it was not there."""
    before = path.stat().st_size if path.exists() else None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        if before is None:
            path.unlink(missing_ok=True)
        else:
            os.ftruncate(fd, before)
        raise
    finally:
        os.close(fd)


def resume_note(resume_step: int | None, loaded: int | None) -> str | None:
    """What a rank that does not resume from the job's step says (``AEGIS_RESUME_STEP``: the
    newest step every pod committed; 0: a fresh start for all): its peers resume from that
    one, it from another. None when it resumes as told (or was told nothing)."""
    if resume_step is None or loaded == resume_step or (loaded is None and resume_step == 0):
        return None
    got = f"step {loaded}" if loaded is not None else "nothing (a fresh start)"
    return (f"checkpoint: the job resumes from step {resume_step}, which this rank does not "
            f"have: it loads {got}, its peers step {resume_step}")  # fmt: skip
