"""The training side: :class:`Saver` copies a state into shared memory and loads it back.

torch is imported inside the methods, so ``import aegis.checkpoint`` stays light.
"""

from __future__ import annotations

import enum
import errno
import functools
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Siblings by their module path, not through the package: the package re-exports this module.
import aegis.checkpoint.collective as ckpt_collective
import aegis.checkpoint.layout as lay
import aegis.checkpoint.nested as ckpt_nested
import aegis.checkpoint.outage as ckpt_outage
import aegis.checkpoint.safe_pickle as ckpt_safe
import aegis.checkpoint.shm_read as ckpt_shm
import aegis.checkpoint.store as ckpt_store
from aegis.core.errors import AegisError

log = logging.getLogger(__name__)


class BusyPolicy(enum.StrEnum):
    WAIT = "wait"  # block until the previous save is durable (default: training never loses one)
    RAISE = "raise"  # raise SaverBusyError at once


class ShmFullError(AegisError):
    """The shared-memory filesystem has no room for the save's buffer (the pod's /dev/shm)."""

    def __init__(self, directory: Path, needed: int, free: int) -> None:
        super().__init__(
            f"checkpoint not saved: {directory} needs {needed} more bytes for the save's buffer "
            f"and has {free} bytes free (raise the pod's shared-memory size)"
        )


class SaverBusyError(AegisError):
    """The previous save is still being persisted (policy ``raise``, or ``wait`` timed out)."""

    def __init__(self, step: int, pending: list[int], waited_s: float) -> None:
        super().__init__(
            f"checkpoint step {step} not saved: step(s) {pending} still being persisted "
            f"after {waited_s:.1f} s (is the saver daemon running?)"
        )
        self.step = step
        self.pending = pending


@dataclass(frozen=True, slots=True)
class SaverSettings:
    shm_dir: Path
    ckpt_dir: Path | None = None
    policy: BusyPolicy = BusyPolicy.WAIT
    wait_timeout_s: float = 600.0
    poll_s: float = 0.005
    resume_step: int | None = None  # the job's committed step: never resume past it
    local_world: int = 0  # >1: one of that many ranks of the pod, in its own local-<k>/ slots
    incarnation: int = lay.UNKNOWN  # AEGIS_RESTART_COUNT, stamped on every slot it saves

    @property
    def pod_shm_dir(self) -> Path:
        """The pod's shared memory (the daemon's outage records, ``local-world-size``)."""
        return self.shm_dir.parent if self.local_world > 1 else self.shm_dir

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> SaverSettings:
        """``AEGIS_CKPT_SHM`` (default ``/dev/shm/aegis-<AEGIS_JOB>-<AEGIS_POD>``),
        ``AEGIS_CKPT_DIR``, ``AEGIS_CKPT_POLICY`` (wait|raise), ``AEGIS_CKPT_WAIT_S``,
        ``AEGIS_RESUME_STEP`` (set by the master on a restart: the newest step every pod
        committed, so that all ranks resume from the same one), ``AEGIS_RESTART_COUNT`` (the
        incarnation its slots are stamped with). Where the pod runs several
        ranks (``LOCAL_WORLD_SIZE`` over 1), local rank k uses ``local-<k>/`` of both."""
        env = dict(os.environ if environ is None else environ)
        shm = Path(env.get("AEGIS_CKPT_SHM") or default_shm_dir(env))
        ckpt = Path(env["AEGIS_CKPT_DIR"]) if env.get("AEGIS_CKPT_DIR") else None
        local, local_world = lay.local_rank_of(env), 0
        if local is not None:
            shm, local_world = lay.local_dir(shm, local), int(env["LOCAL_WORLD_SIZE"])
            ckpt = lay.local_dir(ckpt, local) if ckpt is not None else None
        return SaverSettings(
            shm_dir=shm,
            ckpt_dir=ckpt,
            policy=BusyPolicy(env.get("AEGIS_CKPT_POLICY", BusyPolicy.WAIT.value)),
            wait_timeout_s=float(env.get("AEGIS_CKPT_WAIT_S", "600")),
            resume_step=int(env["AEGIS_RESUME_STEP"]) if env.get("AEGIS_RESUME_STEP") else None,
            local_world=local_world,
            incarnation=lay.incarnation_in(env),
        )


def default_shm_dir(env: dict[str, str]) -> str:
    return (
        f"/dev/shm/aegis-{env.get('AEGIS_JOB', 'local')}-{env.get('AEGIS_POD', str(os.getuid()))}"
    )


Found = tuple[int, "ckpt_store.DiskCopy | None"]  # a step, and its copy read from disk (None: shm)


class Saver:
    """One process's view of its pod's checkpoint slots (keeps the shm buffers mapped)."""

    def __init__(self, settings: SaverSettings) -> None:
        self.settings = settings
        self._buffers: dict[int, tuple[int, Any]] = {}  # buffer -> (bytes, uint8 tensor)
        self._said_local_world = False

    def committed_steps(self) -> list[int]:
        return lay.committed(self.settings.shm_dir)

    def pending_steps(self) -> list[int]:
        shm = self.settings.shm_dir
        return [s for s in lay.slot_steps(shm) if not lay.committed_marker(shm, s).exists()]

    def store_down(self) -> bool:
        """The saver daemon cannot persist (its durable directory is full, read-only or gone)."""
        return (self.settings.pod_shm_dir / ckpt_outage.STORE_DOWN).exists()

    def wait_idle(self, step: int) -> None:
        """Wait until the previous save is persisted; not while the store is down: the save
        goes on (the older unpersisted slot is dropped by :meth:`reserve`, the newest kept)."""
        started = time.monotonic()
        warned = False
        while pending := self.pending_steps():
            waited = time.monotonic() - started
            go = ckpt_outage.save_may_proceed(
                self.store_down(), waited, self.settings.wait_timeout_s
            )
            if go is True:
                log.warning("checkpoint step %s kept in shared memory only: step(s) %s not "
                            "persisted (the checkpoint store is down)", step, pending)  # fmt: skip
                return
            if self.settings.policy is BusyPolicy.RAISE or go is False:
                raise SaverBusyError(step, pending, waited)
            if not warned and waited > 5.0:
                warned = True
                log.info("checkpoint step %s waits for step(s) %s to be persisted", step, pending)
            time.sleep(self.settings.poll_s)

    def save(self, step: int, state: Any) -> None:
        """Copy ``state`` into shared memory and hand it to the saver daemon (returns then)."""
        import torch

        tensors: list[Any] = []
        skeleton = ckpt_nested.rebuild(state, functools.partial(_to_ref, tensors, torch))
        blob = pickle.dumps(skeleton, protocol=5)
        ckpt_safe.loads(blob)  # a state a resume could not load fails here, before any copy
        entries, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(lay.TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                           offset, nbytes))  # fmt: skip
            offset = lay.aligned(offset + nbytes)
        buffer, target = self.reserve(step, offset)
        shm = self.settings.shm_dir
        with torch.no_grad():
            for t, e in zip(tensors, entries, strict=True):
                if e.nbytes:
                    flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
                    target[e.offset : e.offset + e.nbytes].copy_(flat)
        layout = lay.Layout(step, buffer, offset, tuple(entries), self.settings.incarnation)
        lay.write_atomic(lay.slot_pkl(shm, step), blob, durable=False)
        lay.write_atomic(lay.slot_json(shm, step), _dumps(layout), durable=False)

    def reserve(self, step: int, nbytes: int) -> tuple[int, Any]:
        """Wait until the previous save is persisted, then return the buffer a save of ``step``
        writes (the one the newest committed slot before it does not use) as a uint8 tensor of
        at least ``nbytes`` bytes, mapped from shared memory (kept mapped between saves)."""
        import torch

        self.wait_idle(step)
        shm = self.settings.shm_dir
        shm.mkdir(parents=True, exist_ok=True)
        if self.settings.local_world > 1 and not self._said_local_world:
            world = str(self.settings.local_world).encode()
            lay.write_atomic(self.settings.pod_shm_dir / lay.LOCAL_WORLD, world, durable=False)
            self._said_local_world = True
        self.drop_from(step)
        for unpersisted in self.pending_steps():  # only while the store is down (wait_idle)
            _drop_slot(shm, unpersisted)
        committed = [s for s in self.committed_steps() if s < step]
        buffer = 0
        if committed:
            buffer = 1 - lay.read_layout(shm, committed[-1]).buffer
        for old in committed[:-1]:  # stale slots may point at the buffer we overwrite
            _drop_slot(shm, old)
        return buffer, self._buffer(buffer, max(nbytes, 1), torch)

    def drop_from(self, step: int) -> None:
        """A step saved again after a rollback (the rank resumed from an earlier step): the
        slots of that step and later belong to an abandoned timeline and go, so that the
        daemon persists this one anew (a left marker would make it look committed already)."""
        for abandoned in (s for s in lay.slot_steps(self.settings.shm_dir) if s >= step):
            _drop_slot(self.settings.shm_dir, abandoned)

    def grow(self, buffer: int, nbytes: int) -> Any:
        """The buffer ``buffer`` (just reserved) mapped again with at least ``nbytes`` bytes;
        what was written through the earlier mapping stays (same file)."""
        import torch

        return self._buffer(buffer, max(nbytes, 1), torch)

    def _buffer(self, buffer: int, size: int, torch: Any) -> Any:
        cached = self._buffers.get(buffer)
        if cached is not None and cached[0] >= size:
            return cached[1]
        path = lay.buffer_path(self.settings.shm_dir, buffer)
        held = path.stat().st_size if path.exists() else 0
        size = max(size, held)
        try:
            lay.allocate(path, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            free = os.statvfs(path.parent)
            raise ShmFullError(path.parent, size - held, free.f_bavail * free.f_frsize) from exc
        storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=size)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._buffers[buffer] = (size, tensor)
        return tensor

    def load_latest(self, template: Any = None, *, agree: bool = True) -> tuple[int, Any] | None:
        """The newest committed state: from shared memory if there is one, else from disk
        (read into the template's tensors where they fit: one copy). Under torch.distributed
        (more than one rank) the ranks first agree on the step (``collective.agree_on_step``;
        under NCCL, after ``torch.cuda.set_device``): a rank whose copy of the job's step is
        damaged takes every rank back with it, not only itself. Every rank then calls it, as
        every rank saves; ``agree=False``: this rank alone. The template is written only with
        the step agreed on."""
        find = self._find_newest
        found = ckpt_collective.agree_on_step(find) if agree else find(None)
        return self._resumed(None if found is None else self._read(found, template))

    def _find_newest(self, at_most: int | None) -> Found | None:
        """The newest step this rank can load (at most ``at_most``): committed in shared memory
        (no copy: it is read from there), else the newest whole copy on disk."""
        committed = self._at_most_resume(self.committed_steps(), at_most)
        return (committed[-1], None) if committed else self._find_on_disk(at_most)

    def _find_on_disk(self, at_most: int | None) -> Found | None:
        """The newest whole copy on disk (read and checked: a damaged one is skipped)."""
        ckpt = self.settings.ckpt_dir
        if ckpt is None:
            return None
        refused: list[ckpt_safe.UnsafeCheckpointError] = []
        for step in reversed(self._at_most_resume(lay.disk_steps(ckpt), at_most)):
            try:
                return step, ckpt_store.read_committed(ckpt, step)
            except ckpt_store.CorruptCheckpointError as exc:
                log.warning("checkpoint step %s skipped: %s", exc.step, exc.reason)
            except ckpt_safe.UnsafeCheckpointError as exc:
                log.warning("checkpoint step %s skipped: %s", step, exc)
                refused.append(exc)
        if refused:  # copies there, none allowed: no fresh start (the training must allow them)
            raise refused[-1]
        return None

    def _read(self, found: Found, template: Any) -> tuple[int, Any]:
        """The state of the step found, read into the template's tensors where they fit."""
        import torch

        step, copy = found
        if copy is not None:
            data = torch.frombuffer(copy.data, dtype=torch.uint8) if copy.data else torch.empty(0)
            log.info("checkpoint step %s loaded from %s", step, self.settings.ckpt_dir)
            return step, _build(copy.layout, copy.skeleton, data, template, torch)
        shm = self.settings.shm_dir
        layout = lay.read_layout(shm, step)
        skeleton = ckpt_safe.loads(lay.slot_pkl(shm, step).read_bytes())
        fd = os.open(lay.buffer_path(shm, layout.buffer), os.O_RDONLY)
        try:
            jobs: list[tuple[int, Any]] = []
            read = functools.partial(_read_tensor, fd, layout, jobs)
            state = ckpt_nested.rebuild(skeleton, read, template)
            ckpt_shm.read_into(fd, jobs)
        finally:
            os.close(fd)
        log.info("checkpoint step %s loaded from shared memory", step)
        return step, state

    def _resumed(self, loaded: tuple[int, Any] | None) -> tuple[int, Any] | None:
        if note := lay.resume_note(self.settings.resume_step, loaded and loaded[0]):
            log.warning("%s", note)
        return loaded

    def load_from_disk(self, template: Any = None) -> tuple[int, Any] | None:
        """The newest whole copy on disk (never shared memory), read into the template."""
        found = self._find_on_disk(None)
        return None if found is None else self._read(found, template)

    def _at_most_resume(self, steps: list[int], at_most: int | None = None) -> list[int]:
        """A rank may have committed a step its peers have not: it resumes with them (and at
        most ``at_most``: a step its peers could load)."""
        limits = [x for x in (self.settings.resume_step, at_most) if x is not None]
        return [s for s in steps if s <= min(limits)] if limits else steps


def _read_tensor(
    fd: int, layout: lay.Layout, jobs: list[tuple[int, Any]], value: Any, template: Any
) -> Any:
    """A leaf of the skeleton: a TensorRef becomes its tensor of the slot, to be read (``jobs``)
    into the template's tensor when it fits (same shape and dtype, contiguous, on the CPU), or
    into a new one; read now and put in the template's place (:func:`_placed`) when it does not
    fit. Any other leaf stays."""
    import torch

    if not isinstance(value, lay.TensorRef):
        return value
    entry = layout.tensors[value.index]
    dtype = getattr(torch, entry.dtype)
    if (
        isinstance(template, torch.Tensor)
        and tuple(template.shape) == entry.shape
        and template.dtype == dtype
        and template.device.type == "cpu"
        and template.is_contiguous()
    ):
        jobs.append((entry.offset, template))
        return template
    target = torch.empty(entry.shape, dtype=dtype)
    if isinstance(template, torch.Tensor):
        ckpt_shm.read_into(fd, [(entry.offset, target)])
        return _placed(target, template, torch)  # on a GPU, or not contiguous: still in place
    jobs.append((entry.offset, target))
    return target


def _drop_slot(shm: Path, step: int) -> None:
    for path in (
        lay.slot_json(shm, step),
        lay.slot_pkl(shm, step),
        lay.committed_marker(shm, step),
    ):
        path.unlink(missing_ok=True)


def _dumps(layout: lay.Layout) -> bytes:
    return json.dumps(layout.to_json()).encode()


def _to_ref(tensors: list[Any], torch: Any, value: Any, _template: Any) -> Any:
    """A leaf of the state: a tensor is appended to ``tensors`` and its number left in the
    skeleton; any other leaf stays."""
    if not isinstance(value, torch.Tensor):
        return value
    tensors.append(value)
    return lay.TensorRef(len(tensors) - 1)


def _build(layout: lay.Layout, skeleton: Any, data: Any, template: Any, torch: Any) -> Any:
    """The state of a checkpoint read from disk (``data`` its bytes), each tensor put in the place
    of the template's tensor at the same key (:func:`_placed`)."""
    tensors = []
    for e in layout.tensors:
        dtype = getattr(torch, e.dtype)
        raw = data[e.offset : e.offset + e.nbytes]
        tensors.append(raw.view(dtype).reshape(e.shape))

    def place(value: Any, like: Any) -> Any:
        if not isinstance(value, lay.TensorRef):
            return value
        return _placed(tensors[value.index], like, torch)

    return ckpt_nested.rebuild(skeleton, place, template)


def _placed(loaded: Any, template: Any, torch: Any) -> Any:
    """The loaded tensor in the place of the template's: copied into it in place when shape and
    dtype match (no new memory), else moved to its device and dtype; as it is without one."""
    if not isinstance(template, torch.Tensor):
        return loaded
    if template.shape == loaded.shape and template.dtype == loaded.dtype:
        with torch.no_grad():
            return template.copy_(loaded)
    return loaded.to(device=template.device, dtype=template.dtype)


@functools.cache
def shared_saver(settings: SaverSettings) -> Saver:
    """One Saver per settings in a process (``aegis.checkpoint.save`` and the DCP writer
    alike), so the shared-memory buffers stay mapped between saves."""
    return Saver(settings)
