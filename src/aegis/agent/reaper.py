"""The one owner of ``waitpid`` in the agent process, and the way every child is started.

On SIGCHLD the reaper calls ``os.waitpid(-1, WNOHANG)`` until nothing is left, so zombies of every
kind (our children, and orphans re-parented to us as PID 1 or subreaper) are collected. A child
started with :meth:`Reaper.spawn` gets its raw wait status through :meth:`Reaper.wait`; any other
pid is reaped and forgotten. Nothing else in the agent may wait for a process: no
``subprocess.Popen.wait``/``poll``, no asyncio child watcher (a second waiter turns a crash into
exit 0, see CPython's ``Popen`` ECHILD handling).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
from collections.abc import Mapping, Sequence

from aegis.spawn import spawner

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def exit_status(raw: int) -> int:
    """Shell-style status from a raw wait status: the exit code, or 128+N after signal N."""
    code = os.waitstatus_to_exitcode(raw)
    return 128 - code if code < 0 else code


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (unless it already is PID 1)."""
    if os.getpid() == 1:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def adopts_orphans() -> bool:
    """Whether orphaned descendants re-parent to this process (PID 1, or a child subreaper)."""
    if os.getpid() == 1:
        return True
    flag = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(flag.value)


class Reaper:
    """Use as ``async with Reaper() as reaper``: SIGCHLD handled while inside."""

    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future[int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> Reaper:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGCHLD, self.reap)
        self.reap()
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.remove_signal_handler(signal.SIGCHLD)
        self.reap()

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], *, fds: Mapping[int, int] | None = None
    ) -> int:
        """Start ``argv`` as :func:`aegis.spawn.spawner.start` does (a process group of its own,
        ``fds`` mapping a child's descriptor to one of ours); its pid. Raises OSError when exec
        fails. The agent's :class:`~aegis.spawn.spawner.Spawner`."""
        assert self._loop is not None, "spawn() outside 'async with Reaper()'"
        pid = spawner.start(argv, env, fds)
        self._waiters[pid] = self._loop.create_future()
        return pid

    async def wait(self, pid: int) -> int:
        """The raw wait status of a child started by :meth:`spawn` (many callers may wait)."""
        return await asyncio.shield(self._waiters[pid])

    def status(self, pid: int) -> asyncio.Future[int]:
        """The future of a spawned child's raw wait status (await it through ``asyncio.shield``)."""
        return self._waiters[pid]

    def exited(self, pid: int) -> bool:
        future = self._waiters.get(pid)
        return future is None or future.done()

    def reap(self) -> None:
        while True:
            try:
                pid, raw = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            future = self._waiters.get(pid)
            if future is None:
                log.debug("reaped orphan %s (status %s)", pid, exit_status(raw))
            elif not future.done():
                future.set_result(raw)

    def started(self) -> frozenset[int] | None:
        """The children started by :meth:`spawn` whose status has not been forgotten, where any
        other child is an orphan re-parented to this process; None where orphans do not come
        here (not PID 1 nor a subreaper: another child is someone else's, as in a test)."""
        return frozenset(self._waiters) if adopts_orphans() else None

    def forget(self, pid: int) -> None:
        """Drop the bookkeeping of a child whose status has been read."""
        future = self._waiters.get(pid)
        if future is not None and future.done():
            del self._waiters[pid]
