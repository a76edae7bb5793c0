"""The saver daemon: ``python -m aegis.checkpoint.daemon --shm-dir D --ckpt-dir C``.

It polls the shared-memory directory for handed-off slots (``slot-<step>.json``), persists each
one (:func:`store.persist`), then drops older slots but the previous committed one (it is
still whole in the other buffer: a rank that saved past the step its peers committed resumes
from it without a disk read; ``Saver.save`` drops it before reusing that buffer), writes
``committed-<step>`` and appends a
line to ``commits.jsonl``, with the incarnation that saved the slot (see
:mod:`aegis.checkpoint.layout`). Killed at any point, it leaves at most a ``.tmp-step-*``
directory (removed at the next start) and the slot it was writing is persisted again after the
restart. It imports no torch.

A durable directory that fails (full, read-only, vanished) stalls nothing: each failed attempt
is recorded in ``store.jsonl`` (the agent forwards it to the master) and ``store-down`` stays in
the shared-memory directory while it lasts, so saves go on from memory; the daemon retries the
newest pending slot with backoff (:mod:`aegis.checkpoint.outage`) and commits it when it can.

A pod whose command runs several ranks has a ``local-<k>/`` slot directory for each (see
:mod:`aegis.checkpoint.layout`): each is served by a thread of its own (a DCP coordinator's slot
waits on disk for its local peers' files, which another thread writes), persisted into
``<ckpt>/local-<k>/`` (a DCP slot: into its step's directory), and a step goes into the pod's
``commits.jsonl`` once every local rank has committed it. The outage records stay the pod's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aegis.checkpoint import layout as lay
from aegis.checkpoint import outage, store
from aegis.checkpoint.dcp import slot as dcp_slot

log = logging.getLogger(__name__)


def commit_one(
    shm: Path,
    ckpt: Path,
    step: int,
    max_write_mb_s: float,
    keep: int,
    still_handed: Callable[[], bool] | None = None,
    hold: int | None = None,
) -> Path:
    """Persist ``step`` of the slot directory ``shm``, mark it committed there, append it to
    that directory's ``commits.jsonl`` with the incarnation that saved it; where it went.
    ``hold``: the job's committed step (``layout.held_from``): it is not pruned, nor the newer
    steps the job may still resume from (``layout.held``)."""
    started = time.monotonic()
    incarnation = lay.slot_incarnation(shm, step)  # (a slot replaced meanwhile is not committed)
    dcp = dcp_slot.read(shm, step)
    if dcp is None:
        final = store.persist(shm, ckpt, step, max_write_mb_s, still_handed)
    else:  # a torch distributed checkpoint: DCP's own format, in its directory
        final = dcp_slot.persist(shm, dcp, keep, still_handed=still_handed, hold=hold)
        if still_handed is not None and not still_handed():  # after .metadata: not in shm
            raise store.SlotReplacedError(step)
    left = store.prune(ckpt, keep, step, hold)  # before the commit is announced: it is final
    if left > keep:
        log.info("%s keeps %d steps, not %d: the job may still resume from step %s (a pod "
                 "behind: its store down?)", ckpt, left, keep, hold)  # fmt: skip
    older = [s for s in lay.slot_steps(shm) if s < step]
    previous = max((s for s in older if lay.committed_marker(shm, s).exists()), default=None)
    for stale in older:
        if stale != previous:
            for path in (lay.slot_json(shm, stale), lay.slot_pkl(shm, stale)):
                path.unlink(missing_ok=True)
            lay.committed_marker(shm, stale).unlink(missing_ok=True)
    lay.committed_marker(shm, step).write_bytes(b"")
    with (shm / lay.COMMITS_LOG).open("a") as out:
        out.write(commit_line(step, final, incarnation))
    log.info("step %s committed to %s in %.2f s", step, final, time.monotonic() - started)
    return final


def commit_line(step: int, final: Path, incarnation: int) -> str:
    """The line of ``commits.jsonl`` that announces the commit of ``step``."""
    record = {"step": step, "path": str(final), "ts": time.time(), "incarnation": incarnation}
    return json.dumps(record) + "\n"


@dataclass(frozen=True, slots=True)
class Where:
    """One slot directory the daemon serves: the pod's shared memory (its outage records and
    commits), the directory of the slots (the pod's own, or a local rank's) and their durable
    directory."""

    pod: Path
    slots: Path
    ckpt: Path


@dataclass(slots=True)
class Shared:
    """What the threads of one daemon share: the store's outage state, the last pod commit
    announced for local ranks (the identities of the markers it was announced on)."""

    state: outage.StoreState
    lock: threading.Lock = field(default_factory=threading.Lock)
    announced: tuple[tuple[int, int], ...] = ()
    warned: bool = False  # that a local rank never saves (said once)


def announce(where: Where, step: int, final: Path, shared: Shared) -> None:
    """After a local rank's commit (``shared.lock`` held): the pod's commit of ``step`` once
    every local rank committed it (said once per set of commit markers)."""
    if where.slots == where.pod:
        return  # commit_one wrote the pod's own line
    dirs, expected = lay.local_dirs(where.pod), lay.expected_local_ranks(where.pod)
    if len(dirs) < expected and len(lay.committed(where.slots)) > 1 and not shared.warned:
        shared.warned = True
        log.warning("%s committed its second save, but only %d of the pod's %d local ranks "
                    "ever saved: no step is the pod's commit until every local rank saves it "
                    "(every rank calls aegis.checkpoint.save)", where.slots.name, len(dirs),
                    expected)  # fmt: skip
    if not lay.pod_committed(step, expected, map(lay.committed, dirs)):
        return
    try:
        markers = tuple(_identity(lay.committed_marker(d, step)) for d in dirs)
    except FileNotFoundError:  # a rank rolled back meanwhile: its next commit says it
        return
    if markers == shared.announced:
        return
    shared.announced = markers
    incarnation = lay.pod_incarnation(lay.slot_incarnation(d, step) for d in dirs)
    with (where.pod / lay.COMMITS_LOG).open("a") as out:
        out.write(commit_line(step, final, incarnation))
    log.info("step %s committed by all %d local ranks", step, len(dirs))


def _identity(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_ino, info.st_mtime_ns


def handed_identity(shm: Path, step: int) -> tuple[int, int] | None:
    """Which hand-off of ``step`` is in place (a save of it anew makes a new file)."""
    try:
        info = lay.slot_json(shm, step).stat()
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_mtime_ns


def attempt(where: Where, step: int, shared: Shared, max_write_mb_s: float, keep: int,
            poll_s: float) -> float:  # fmt: skip
    """Persist and commit ``step`` of ``where`` once; the wait before the next attempt. A slot
    dropped or replaced meanwhile (a save went on while the store was down) is not committed
    and is no failure of the store."""
    shm, ckpt = where.slots, where.ckpt
    handed = handed_identity(shm, step)
    if handed is None:  # gone since it was listed: nothing to do before the next save
        return poll_s

    def still_handed() -> bool:
        return handed_identity(shm, step) == handed

    try:
        final = commit_one(shm, ckpt, step, max_write_mb_s, keep, still_handed,
                           lay.held_from(where.pod))  # fmt: skip
    except store.SlotReplacedError:
        log.info("step %s replaced by a newer save while persisting; not committed", step)
        return 0.0
    except OSError as exc:
        if not still_handed():  # the slot was replaced while we read it: try again
            log.warning("step %s vanished while persisting (%s); retrying", step, exc)
            return 0.0
        with contextlib.suppress(OSError):
            store.discard_torn(ckpt, step)
        with contextlib.suppress(OSError):
            make_room(shm, ckpt, step, keep, lay.held_from(where.pod))
        with shared.lock:
            shared.state, wait_s = store_failed(where.pod, ckpt, step, shared.state, exc)
        return wait_s
    with shared.lock:
        shared.state = store_worked(where.pod, ckpt, step, shared.state)
        announce(where, step, final, shared)
    return 0.0


def make_room(shm: Path, ckpt: Path, step: int, keep: int, hold: int | None) -> None:
    """After a failed attempt, prune as after a commit: a disk filled with steps the job might
    have resumed from (held while another pod's store was down) has room again once the job's
    committed step moved on, though this pod commits nothing until then (it pruned only after
    a commit, so it stayed full for good)."""
    dcp = dcp_slot.read(shm, step)
    if dcp is None:
        store.prune(ckpt, keep, None, hold)
    elif dcp.metadata is not None:  # the coordinator's: it prunes DCP's steps
        dcp_slot.prune(dcp.directory.parent, keep, hold)


def store_failed(
    shm: Path, ckpt: Path, step: int, state: outage.StoreState, exc: OSError
) -> tuple[outage.StoreState, float]:
    """Record the failed attempt where the agent reads it (every one: the master counts them)
    and keep ``store-down`` in place, so that saves go on from memory."""
    now = time.time()
    result = outage.failed(state, now)
    failure = outage.Failure.of(exc, step, str(ckpt))
    record = {"event": "failed", "step": step, "errno": failure.errno,
              "strerror": failure.strerror, "dir": failure.directory,
              "opened": result.opened, "failures": result.state.failures,
              "since": result.state.since, "ts": now}  # fmt: skip
    line = json.dumps(record)
    with contextlib.suppress(OSError):
        lay.write_atomic(shm / outage.STORE_DOWN, line.encode(), durable=False)
        with (shm / outage.STORE_LOG).open("a") as out:
            out.write(line + "\n")
    if result.opened:
        log.error("step %s not persisted: %s; training goes on from shared memory (the newest "
                  "save kept), retrying with backoff", step, failure.describe())  # fmt: skip
    else:
        log.debug("step %s not persisted (attempt %d): %s; retrying in %.2f s", step,
                  result.state.failures, failure.describe(), result.retry_in_s)  # fmt: skip
    return result.state, result.retry_in_s


def store_worked(shm: Path, ckpt: Path, step: int, state: outage.StoreState) -> outage.StoreState:
    result = outage.succeeded(state, time.time())
    if result.closed_after_s is not None:
        (shm / outage.STORE_DOWN).unlink(missing_ok=True)
        record = {"event": "resumed", "step": step, "dir": str(ckpt),
                  "down_s": result.closed_after_s, "failures": state.failures,
                  "ts": time.time()}  # fmt: skip
        with (shm / outage.STORE_LOG).open("a") as out:
            out.write(json.dumps(record) + "\n")
        log.warning("checkpoint store %s back after %.1f s (%d failed attempts): step %s "
                    "committed", ckpt, result.closed_after_s, state.failures, step)  # fmt: skip
    return result.state


def resumed_state(shm: Path) -> outage.StoreState:
    """An outage a killed daemon left (``store-down``) goes on: not reported a second time."""
    try:
        record = json.loads((shm / outage.STORE_DOWN).read_bytes())
        return outage.StoreState(int(record["failures"]), float(record["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return outage.StoreState()


def serve(shm: Path, ckpt: Path, poll_s: float, max_write_mb_s: float, keep: int) -> None:
    """Serve the pod's slot directory, and each local rank's as it appears (a thread each)."""
    shm.mkdir(parents=True, exist_ok=True)
    shared = Shared(resumed_state(shm))
    try:
        ckpt.mkdir(parents=True, exist_ok=True)
        store.clean_tmp(ckpt)
    except OSError as exc:  # a read-only or vanished store: each attempt reports it
        log.error("checkpoint directory %s not usable: %s", ckpt, exc)
    served: set[Path] = set()
    while True:
        for slots in lay.slot_dirs(shm):
            if slots not in served:
                served.add(slots)
                where = Where(shm, slots, ckpt if slots == shm else ckpt / slots.name)
                args = (where, shared, poll_s, max_write_mb_s, keep)
                threading.Thread(target=serve_slots, args=args, daemon=True).start()
        time.sleep(poll_s * 5)


def serve_slots(
    where: Where, shared: Shared, poll_s: float, max_write_mb_s: float, keep: int
) -> None:
    """One slot directory's loop. What it does not expect ends the whole daemon, as it did
    before threads (the agent starts a new one), rather than leave the directory unserved."""
    try:
        if where.slots != where.pod:
            with contextlib.suppress(OSError):
                where.ckpt.mkdir(parents=True, exist_ok=True)
                store.clean_tmp(where.ckpt)
        while True:
            steps = lay.pending(where.slots)
            wait_s = (
                attempt(where, steps[-1], shared, max_write_mb_s, keep, poll_s) if steps else poll_s
            )
            time.sleep(wait_s)
    except BaseException:
        log.exception("serving %s failed", where.slots)
        logging.shutdown()
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aegis.checkpoint.daemon")
    parser.add_argument("--shm-dir", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--poll-s", type=float, default=0.02)
    parser.add_argument("--max-write-mb-s", type=float, default=0.0, help="0: no rate limit")
    parser.add_argument("--keep", type=int, default=3, help="committed copies kept on disk")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s saver %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("saver daemon %s: %s -> %s", os.getpid(), args.shm_dir, args.ckpt_dir)
    serve(args.shm_dir, args.ckpt_dir, args.poll_s, args.max_write_mb_s, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
