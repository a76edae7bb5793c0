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
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36

# Dispositions a child must not inherit from us (Python ignores SIGPIPE and SIGXFSZ; a parent may
# have ignored SIGHUP or SIGINT).
_RESET_SIGNALS = (
    signal.SIGPIPE,
    signal.SIGXFSZ,
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCHLD,
    signal.SIGTTIN,
    signal.SIGTTOU,
)


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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._loop is not None
        self._loop.remove_signal_handler(signal.SIGCHLD)
        self.reap()

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        fds: Mapping[int, int] | None = None,
        new_group: bool = True,
    ) -> int:
        """Start ``argv`` (PATH lookup) and return its pid; raises OSError when exec fails.

        ``fds`` maps a child descriptor (1, 2) to one of ours; ``new_group`` puts the child in a
        process group of its own.
        """
        assert self._loop is not None, "spawn() outside 'async with Reaper()'"
        actions = [(os.POSIX_SPAWN_DUP2, ours, theirs) for theirs, ours in (fds or {}).items()]
        options: dict[str, Any] = {}
        if new_group:
            options["setpgroup"] = 0
        pid = os.posix_spawnp(
            argv[0],
            list(argv),
            dict(env),
            file_actions=actions,
            setsigmask=(),
            setsigdef=_RESET_SIGNALS,
            **options,
        )
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

    def forget(self, pid: int) -> None:
        """Drop the bookkeeping of a child whose status has been read."""
        future = self._waiters.get(pid)
        if future is not None and future.done():
            del self._waiters[pid]
