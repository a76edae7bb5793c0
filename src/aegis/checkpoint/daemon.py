"""The saver daemon: ``python -m aegis.checkpoint.daemon --shm-dir D --ckpt-dir C``.

It polls the shared-memory directory for handed-off slots (``slot-<step>.json``), persists each
one (:func:`store.persist`), then drops older slots but the previous committed one (it is
still whole in the other buffer: a rank that saved past the step its peers committed resumes
from it without a disk read; ``Saver.save`` drops it before reusing that buffer), writes
``committed-<step>`` and appends a
line to ``commits.jsonl``. Killed at any point, it leaves at most a ``.tmp-step-*`` directory
(removed at the next start) and the slot it was writing is persisted again after the restart.
It imports no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aegis.checkpoint import layout as lay
from aegis.checkpoint import store
from aegis.checkpoint.dcp import slot as dcp_slot

log = logging.getLogger(__name__)


def pending(shm: Path) -> list[int]:
    return [s for s in lay.slot_steps(shm) if not lay.committed_marker(shm, s).exists()]


def commit_one(shm: Path, ckpt: Path, step: int, max_write_mb_s: float, keep: int) -> None:
    started = time.monotonic()
    dcp = dcp_slot.read(shm, step)
    if dcp is None:
        final = store.persist(shm, ckpt, step, max_write_mb_s)
    else:  # a torch distributed checkpoint: DCP's own format, in its directory
        final = dcp_slot.persist(shm, dcp, keep)
    store.prune(ckpt, keep)  # before the commit is announced: a reported commit is final
    older = [s for s in lay.slot_steps(shm) if s < step]
    previous = max((s for s in older if lay.committed_marker(shm, s).exists()), default=None)
    for stale in older:
        if stale != previous:
            for path in (lay.slot_json(shm, stale), lay.slot_pkl(shm, stale)):
                path.unlink(missing_ok=True)
            lay.committed_marker(shm, stale).unlink(missing_ok=True)
    lay.committed_marker(shm, step).write_bytes(b"")
    line = json.dumps({"step": step, "path": str(final), "ts": time.time()})
    with (shm / lay.COMMITS_LOG).open("a") as out:
        out.write(line + "\n")
    log.info("step %s committed to %s in %.2f s", step, final, time.monotonic() - started)


def serve(shm: Path, ckpt: Path, poll_s: float, max_write_mb_s: float, keep: int) -> None:
    shm.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)
    store.clean_tmp(ckpt)
    while True:
        steps = pending(shm)
        if not steps:
            time.sleep(poll_s)
            continue
        step = steps[0]
        try:
            commit_one(shm, ckpt, step, max_write_mb_s, keep)
        except FileNotFoundError as exc:  # the slot was replaced while we read it: try again
            log.warning("step %s vanished while persisting (%s); retrying", step, exc)
        except OSError as exc:
            log.error("step %s not persisted: %s; retrying in 1 s", step, exc)
            time.sleep(1.0)


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
