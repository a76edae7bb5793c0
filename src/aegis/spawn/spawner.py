"""The ``Spawner`` port: start a child with some descriptors, await its raw wait status.

The agent's reaper (:class:`aegis.agent.reaper.Reaper`, the one owner of ``waitpid`` in the
agent) is the Spawner of everything the agent starts: the checks' forkserver, the checkpoint
saver daemon, the zygotes. :class:`LocalSpawner` is the Spawner of a process with no reaper
(tests, benchmarks, ``aegis check``): a thread waits for each child. Both start a child with
:func:`start`; one contract suite (``tests/test_spawner_contract.py``) runs against both.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Protocol

# Dispositions a child must not inherit from us (Python ignores SIGPIPE and SIGXFSZ; a parent may
# have ignored SIGHUP or SIGINT).
RESET_SIGNALS = (
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


class Spawner(Protocol):
    """Starts children and is the one that waits for them."""

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], *, fds: Mapping[int, int] | None = None
    ) -> int:
        """Start ``argv`` as :func:`start` does; its pid. Raises OSError when exec fails."""
        ...

    async def wait(self, pid: int) -> int:
        """The raw wait status of a child :meth:`spawn` started (many callers may wait)."""
        ...

    def forget(self, pid: int) -> None:
        """Drop the bookkeeping of a child whose status has been read."""
        ...


def start(argv: Sequence[str], env: Mapping[str, str], fds: Mapping[int, int] | None) -> int:
    """Start ``argv`` (PATH lookup) in a process group of its own, with Python's start-up signal
    dispositions and an empty signal mask; its pid. Raises OSError when exec fails.

    ``fds`` maps a child's descriptor (1, 2, ...) to one of ours.
    """
    actions = [(os.POSIX_SPAWN_DUP2, ours, theirs) for theirs, ours in (fds or {}).items()]
    return os.posix_spawnp(
        argv[0],
        list(argv),
        dict(env),
        file_actions=actions,
        setpgroup=0,
        setsigmask=(),
        setsigdef=RESET_SIGNALS,
    )


class LocalSpawner:
    """A Spawner for processes that have no reaper: a thread waits for each child."""

    def __init__(self) -> None:
        self._children: dict[int, asyncio.Task[int]] = {}

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], *, fds: Mapping[int, int] | None = None
    ) -> int:
        loop = asyncio.get_running_loop()
        pid = start(argv, env, fds)
        self._children[pid] = loop.create_task(asyncio.to_thread(_wait, pid), name=f"wait-{pid}")
        return pid

    async def wait(self, pid: int) -> int:
        return await asyncio.shield(self._children[pid])

    def forget(self, pid: int) -> None:
        task = self._children.get(pid)
        if task is not None and task.done():
            del self._children[pid]


def _wait(pid: int) -> int:
    _, raw = os.waitpid(pid, 0)
    return raw
