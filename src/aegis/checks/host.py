"""The agent's side of its warm check interpreter (:mod:`aegis.checks.forkserver`).

A :class:`CheckHost` keeps one forkserver ready (:class:`aegis.spawn.forkclient.ForkServers`,
started through the agent's reaper, the one owner of ``waitpid`` in the agent; the forkserver
waits for its own children): it imports torch once, and :meth:`CheckHost.fork` then forks a
check child from it in milliseconds instead of the seconds a cold ``import torch`` costs. It is
the only process of the agent's that imports torch before training: the agent itself never does
(its checks that need torch run in that child, :mod:`aegis.checks.group`). One child at a time.
When the forkserver fails to start, is not ready in time, refuses a fork or dies, :meth:`fork`
returns None and the caller starts the child cold (said once in the log); a forkserver that died
is replaced in the background, up to ``max_failures`` times in a row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from aegis.spawn import forkclient
from aegis.spawn import spawner as spawning

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class HostSettings:
    ready_timeout_s: float = 60.0  # a forkserver not ready by then is given up (cold starts)
    fork_timeout_s: float = 10.0
    max_failures: int = 3  # in a row: then cold starts for good
    interpreter: str = sys.executable


@dataclasses.dataclass(frozen=True, slots=True)
class WarmChild:
    pid: int
    args: tuple[str, ...]  # of ``python -m aegis.checks.collective``
    exited: asyncio.Future[int]  # its raw wait status, as the forkserver reports it


class CheckHost:
    """Use as ``async with CheckHost(spawner)`` (or :meth:`close` it when done).

    The first forkserver is started by the first :meth:`fork` (or :meth:`start`), not at once:
    the bootcheck's runtime check makes it (its child is the first fork), so an agent that never
    runs a check never imports torch. From then on one stays ready.
    """

    def __init__(
        self,
        spawner: spawning.Spawner,
        env: Mapping[str, str] | None = None,
        settings: HostSettings | None = None,
    ) -> None:
        self.settings = settings = settings or HostSettings()
        self._spawner = spawner
        server = forkclient.ServerSettings(
            name="check forkserver",
            ready_timeout_s=settings.ready_timeout_s,
            fork_timeout_s=settings.fork_timeout_s,
            max_failures=settings.max_failures,
        )
        command = [settings.interpreter, "-m", "aegis.checks.forkserver"]
        env = os.environ if env is None else env
        self._servers = forkclient.ForkServers(spawner, lambda: command, env, server)
        self._said_cold = False
        self.forked: list[WarmChild] = []  # the children forked warm, in order

    async def __aenter__(self) -> CheckHost:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def made(self) -> int:
        """Forkservers started so far."""
        return self._servers.made

    @property
    def ready_info(self) -> dict[str, Any]:
        """The last forkserver's ready message."""
        return self._servers.ready_info

    @property
    def disabled(self) -> bool:
        return self._servers.disabled

    @property
    def ready_now(self) -> bool:
        """Whether a fork would be served at once (a forkserver is ready, no child running)."""
        return self._servers.ready_now

    def start(self) -> None:
        """Start making a forkserver unless one is ready or on its way."""
        self._servers.prepare()

    async def ready(self) -> int | None:
        """The pid of the forkserver the next fork will use, once ready (None: cold starts)."""
        self.start()
        server = await self._servers.ready()
        return None if server is None else server.pid

    def spawn_cold(
        self, argv: Sequence[str], env: Mapping[str, str], fds: Mapping[int, int]
    ) -> tuple[int, asyncio.Future[int]]:
        """Start a child cold through the agent's reaper (the one ``waitpid`` owner in the
        agent): its pid, and its raw wait status to come."""
        pid = self._spawner.spawn(argv, env, fds=fds)
        return pid, asyncio.ensure_future(self._spawner.wait(pid))

    def note_cold(self, why: str) -> None:
        """The caller starts a check child cold: say so, once."""
        if not self._said_cold:
            self._said_cold = True
            log.warning("check children start cold (%s): no warm check interpreter", why)

    async def fork(self, args: Sequence[str], out_fd: int, err_fd: int) -> WarmChild | None:
        """Fork ``python -m aegis.checks.collective ARGS`` warm; None: start it cold."""
        child = await self._servers.fork({"argv": list(args)}, [out_fd, err_fd])
        if child is None:
            return None
        self.forked.append(WarmChild(child.pid, tuple(args), child.status))
        return self.forked[-1]

    async def close(self) -> None:
        await self._servers.close()
