"""Keeping the saver daemon alive from the agent, and learning which steps were committed.

``DaemonProcess`` starts ``python -m aegis.checkpoint.daemon`` through a
:class:`~aegis.spawn.spawner.Spawner` (the agent passes its reaper, the one owner of ``waitpid``;
:class:`~aegis.spawn.spawner.LocalSpawner` serves elsewhere),
restarts it at once when it dies (:meth:`supervise`), and tails ``commits.jsonl`` in the shared
memory directory, calling ``on_commit(step)`` once per newly committed step (and
``on_stamped_commit(step, incarnation)``, with the incarnation of the training that saved it:
:data:`~aegis.checkpoint.layout.UNKNOWN` where the line does not say it), and ``store.jsonl``,
calling ``on_store(report)`` for the daemon's failed attempts to persist (batched) and recoveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from aegis.checkpoint import layout as lay
from aegis.checkpoint import outage
from aegis.spawn import spawner as spawning

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # a killed daemon is collected by then (the reaper runs on SIGCHLD)

OnCommit = Callable[[int], Awaitable[None]]
OnStampedCommit = Callable[[int, int], Awaitable[None]]  # (step, incarnation)
OnStore = Callable[[outage.StoreReport], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class DaemonSettings:
    shm_dir: Path
    ckpt_dir: Path
    poll_s: float = 0.02
    max_write_mb_s: float = 0.0
    keep: int = 3
    restart_delay_s: float = 0.2
    flush_s: float = 120.0  # at the job's end, how long the last handed-off save may persist

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "aegis.checkpoint.daemon",
            "--shm-dir", str(self.shm_dir), "--ckpt-dir", str(self.ckpt_dir),
            "--poll-s", str(self.poll_s), "--max-write-mb-s", str(self.max_write_mb_s),
            "--keep", str(self.keep),
        ]  # fmt: skip


def hold_from(shm_dir: Path, step: int) -> None:
    """The job's committed step is ``step``: the daemon of ``shm_dir`` keeps it and the newest
    steps after it (``layout.hold_from``); a failure to say so is logged (the daemon then
    prunes by ``keep`` alone)."""
    try:
        shm_dir.mkdir(parents=True, exist_ok=True)
        lay.hold_from(shm_dir, step)
    except OSError as exc:
        log.warning("cannot tell the saver to keep the steps from %d: %s", step, exc)


class DaemonProcess:
    def __init__(
        self,
        settings: DaemonSettings,
        spawner: spawning.Spawner | None = None,
        on_commit: OnCommit | None = None,
        on_store: OnStore | None = None,
        on_stamped_commit: OnStampedCommit | None = None,
    ) -> None:
        self.settings = settings
        self._spawner: spawning.Spawner = spawner or spawning.LocalSpawner()
        self._on_commit = on_commit
        self._on_stamped_commit = on_stamped_commit
        self._on_store = on_store
        self._pid: int | None = None
        self._exited: asyncio.Event = asyncio.Event()
        self._offset = 0
        self._store_offset = 0
        self.last_committed: int | None = None
        self.restarts = 0
        self._supervised = False  # supervise() runs: a dead daemon is started again
        self._stopping: int | None = None  # the daemon stop() kills: its end is no news

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        return self._pid is not None and not self._exited.is_set()

    async def start(self) -> None:
        """Create the shared-memory directory (the agent owns it) and start the daemon."""
        self.settings.shm_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._pid = self._spawner.spawn(self.settings.argv(), env)
        self._exited = asyncio.Event()
        asyncio.get_running_loop().create_task(
            self._watch(self._pid, self._exited), name=f"ckpt-daemon-watch-{self._pid}"
        )
        log.info("checkpoint saver daemon started: pid %s", self._pid)

    async def _watch(self, pid: int, exited: asyncio.Event) -> None:
        raw = await self._spawner.wait(pid)
        self._spawner.forget(pid)
        exited.set()
        if pid == self._stopping:
            log.info("checkpoint saver daemon %s stopped", pid)
        else:
            log.warning("checkpoint saver daemon %s exited (raw status %s)", pid, raw)

    async def stop(self) -> None:
        """SIGKILL the daemon and wait until it is collected (at most ``STOP_WAIT_S``: a
        spawner that no longer collects its children must not hold the agent's end)."""
        if self.alive and self._pid is not None:
            self._stopping = self._pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            try:
                async with asyncio.timeout(STOP_WAIT_S):
                    await self._exited.wait()
            except TimeoutError:
                log.error("checkpoint saver daemon %s killed, not collected in %g s",
                          self._pid, STOP_WAIT_S)  # fmt: skip

    async def restart(self) -> None:
        await self.stop()
        self.restarts += 1
        await self.start()

    async def poll_commits(self) -> list[int]:
        """New commit lines since the last call; calls ``on_commit`` and ``on_stamped_commit``
        for each (a step at or below the last one is a commit of a new timeline, after the rank
        rolled back, or one of a timeline a restart abandoned: its incarnation tells which)."""
        complete, self._offset = _tail(self.settings.shm_dir / lay.COMMITS_LOG, self._offset)
        steps = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                record = json.loads(line)
                step = int(record["step"])
                incarnation = lay.incarnation_of(record.get("incarnation"))
                self.last_committed = step
                steps.append(step)
                if self._on_commit is not None:
                    await self._on_commit(step)
                if self._on_stamped_commit is not None:
                    await self._on_stamped_commit(step, incarnation)
        return steps

    async def poll_store(self) -> list[outage.StoreReport]:
        """The daemon's records of failed attempts to persist (and of the store working again)
        since the last call, batched (:func:`outage.reports_of`); ``on_store`` for each."""
        complete, self._store_offset = _tail(
            self.settings.shm_dir / outage.STORE_LOG, self._store_offset
        )
        records = []
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        reports = outage.reports_of(records)
        for report in reports:
            if report.opened:
                log.error("checkpoint store %s down: [Errno %d] %s (step %d kept in memory)",
                          report.directory, report.errno, report.strerror,
                          report.step)  # fmt: skip
            elif report.ok:
                log.warning("checkpoint store %s back after %.1f s", report.directory,
                            report.down_s)  # fmt: skip
            if self._on_store is not None:
                await self._on_store(report)
        return reports

    async def supervise(self) -> None:
        """Run until cancelled: keep the daemon alive and report commits (kills it on exit)."""
        self._supervised = True
        try:
            if not self.alive:
                await self.start()
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.poll_s * 5):
                        await self._exited.wait()
                await self.poll_commits()
                await self.poll_store()
                if not self.alive:
                    await asyncio.sleep(self.settings.restart_delay_s)
                    await self.restart()
        finally:
            self._supervised = False
            await asyncio.shield(self.stop())

    async def flush(self, interrupted: asyncio.Event | None = None) -> list[int]:
        """Wait until every handed-off save is persisted (a training's save returns once it is
        in shared memory), at most ``flush_s``; see :func:`flush_given_up` for when it stops
        waiting. The steps still not persisted (none: all is on disk)."""
        shm, loop = self.settings.shm_dir, asyncio.get_running_loop()
        deadline = loop.time() + self.settings.flush_s
        while left := lay.pending_anywhere(shm):
            why = flush_given_up(
                store_down=(shm / outage.STORE_DOWN).exists(),
                saver_running=self.alive or self._supervised,
                interrupted=interrupted is not None and interrupted.is_set(),
                timed_out=loop.time() >= deadline,
            )
            if why is not None:
                log.error("checkpoint step(s) %s not persisted: %s", left, why)
                return left
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.poll_s * 5):  # the daemon's own pace
                    await (interrupted or asyncio.Event()).wait()
        return []


def flush_given_up(
    *, store_down: bool, saver_running: bool, interrupted: bool, timed_out: bool
) -> str | None:
    """Why waiting for a handed-off save to persist ends now, if it does: the durable directory
    is down (the daemon retries with backoff, the memory copy is all there is), no daemon runs
    to persist it, the agent was told to stop (a SIGTERM: the platform's grace period is not
    spent on it), or ``flush_s`` passed."""
    if interrupted:
        return "the agent was stopped (SIGTERM)"
    if store_down:
        return "the checkpoint store is down"
    if not saver_running:
        return "no saver daemon runs"
    if timed_out:
        return "timed out"
    return None


def _tail(path: Path, offset: int) -> tuple[bytes, int]:
    """The complete lines of ``path`` past ``offset``, and the offset after them."""
    try:
        with path.open("rb") as src:
            src.seek(offset)
            chunk = src.read()
    except FileNotFoundError:
        return b"", offset
    complete = chunk[: chunk.rfind(b"\n") + 1]
    return complete, offset + len(complete)
