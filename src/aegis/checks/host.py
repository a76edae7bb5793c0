"""The agent's side of its warm check interpreter (:mod:`aegis.checks.forkserver`).

A :class:`CheckHost` keeps one forkserver ready: started through the agent's reaper (the one
owner of ``waitpid`` in the agent; the forkserver waits for its own children), it imports torch
once, and :meth:`CheckHost.fork` then forks a collective check child from it in milliseconds
instead of the seconds a cold ``import torch`` costs. One child at a time. When the forkserver
fails to start, is not ready in time, refuses a fork or dies, :meth:`fork` returns None and the
caller starts the child cold (said once in the log); a forkserver that died is replaced in the
background, up to ``max_failures`` times in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from aegis import forking

log = logging.getLogger(__name__)


class Spawner(Protocol):
    """What the agent's reaper offers: start a child with some descriptors, await its status."""

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        fds: Mapping[int, int] | None = None,
        new_group: bool = True,
    ) -> int: ...

    async def wait(self, pid: int) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class HostSettings:
    ready_timeout_s: float = 60.0  # a forkserver not ready by then is given up (cold starts)
    fork_timeout_s: float = 10.0
    max_failures: int = 3  # in a row: then cold starts for good
    interpreter: str = sys.executable


@dataclasses.dataclass(slots=True, eq=False)
class _Server:
    pid: int
    sock: socket.socket
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    gone: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class WarmChild:
    pid: int
    args: tuple[str, ...]  # of ``python -m aegis.checks.collective``
    exited: asyncio.Future[int]  # its raw wait status, as the forkserver reports it


class CheckHost:
    """Use as ``async with CheckHost(spawner)`` (or :meth:`close` it when done).

    The first forkserver is started by the first :meth:`fork` (or :meth:`start`), not at once:
    at the agent's start it would import torch at the same time as the bootcheck's runtime check
    in the agent, and on a slow node push that check past its budget. From then on one stays
    ready.
    """

    def __init__(
        self,
        spawner: Spawner,
        env: Mapping[str, str] | None = None,
        settings: HostSettings | None = None,
    ) -> None:
        self.settings = settings or HostSettings()
        self._spawner = spawner
        self._env = dict(os.environ if env is None else env)
        self._next: asyncio.Task[_Server | None] | None = None
        self._lock = asyncio.Lock()  # one child at a time
        self._tasks: set[asyncio.Task[None]] = set()
        self._failures = 0
        self._closing = False
        self._said_cold = False
        self.made = 0  # forkservers started
        self.forked: list[WarmChild] = []  # the children forked warm, in order
        self.ready_info: dict[str, Any] = {}  # the last forkserver's ready message

    async def __aenter__(self) -> CheckHost:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def disabled(self) -> bool:
        return self._failures >= self.settings.max_failures

    def start(self) -> None:
        """Start making a forkserver unless one is ready or on its way."""
        if self._closing or self.disabled:
            return
        if self._next is None or (self._next.done() and self._usable(self._next) is None):
            self._next = asyncio.create_task(self._make(), name="check-forkserver")

    @staticmethod
    def _usable(task: asyncio.Task[_Server | None]) -> _Server | None:
        if task.cancelled() or task.exception() is not None:
            return None
        server = task.result()
        return None if server is None or server.gone else server

    @property
    def ready_now(self) -> bool:
        """Whether a fork would be served at once (a forkserver is ready, no child running)."""
        if self._next is None or not self._next.done() or self._lock.locked():
            return False
        return self._usable(self._next) is not None

    async def ready(self) -> int | None:
        """The pid of the forkserver the next fork will use, once ready (None: cold starts)."""
        self.start()
        if self._next is None:
            return None
        server = await asyncio.shield(self._next)
        return None if server is None or server.gone else server.pid

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
            log.warning("collective checks start cold (%s): no warm check interpreter", why)

    async def fork(self, args: Sequence[str], out_fd: int, err_fd: int) -> WarmChild | None:
        """Fork ``python -m aegis.checks.collective ARGS`` warm; None: start it cold."""
        self.start()
        if self._next is None:
            return None
        server = await asyncio.shield(self._next)
        if server is None or server.gone:
            return None
        try:  # the previous child is still going (being killed): not for long
            async with asyncio.timeout(self.settings.fork_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            self.note_cold("the previous check child has not ended")
            return None
        try:
            child = await self._request(server, args, out_fd, err_fd)
        except BaseException:
            self._lock.release()
            raise
        if child is None:
            self._lock.release()
        return child

    async def close(self) -> None:
        self._closing = True
        if self._next is not None:
            if not self._next.done():
                self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                server = await self._next
                if server is not None:
                    self._retire(server)
        self._next = None
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.settings.fork_timeout_s)
        for task in self._tasks:
            task.cancel()

    async def _request(
        self, server: _Server, args: Sequence[str], out_fd: int, err_fd: int
    ) -> WarmChild | None:
        message = json.dumps({"argv": list(args)}).encode() + b"\n"
        try:
            socket.send_fds(server.sock, [message], [out_fd, err_fd])
            async with asyncio.timeout(self.settings.fork_timeout_s):
                answer = await forking.read_message(server.reader, "check forkserver")
        except (OSError, TimeoutError, ValueError) as exc:
            answer = {"event": "broken", "reason": repr(exc)}
        if answer.get("event") != "forked":
            log.warning("check forkserver %s did not fork (%s)", server.pid, answer)
            self._failures += 1
            self._retire(server)
            self.start()
            return None
        pid = int(answer["pid"])
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._spawn_task(self._child_exit(server, pid, exited), f"check-child-{pid}")
        self.forked.append(WarmChild(pid, tuple(args), exited))
        return self.forked[-1]

    async def _child_exit(self, server: _Server, pid: int, exited: asyncio.Future[int]) -> None:
        try:
            answer = await forking.read_message(server.reader, "check forkserver")
            exited.set_result(int(answer["status"]))
        except (OSError, ValueError, KeyError) as exc:  # the forkserver died: so did the child
            log.warning("check forkserver %s gone while child %s ran (%r)", server.pid, pid, exc)
            exited.set_result(signal.SIGKILL)  # the raw wait status of a SIGKILL death
        finally:
            self._lock.release()

    async def _make(self) -> _Server | None:
        while not self.disabled and not self._closing:
            server = await self._make_one()
            if server is not None:
                return server
        return None

    async def _make_one(self) -> _Server | None:
        argv = [self.settings.interpreter, "-m", "aegis.checks.forkserver",
                "--fd", "3", "--agent", str(os.getpid())]  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            pid = self._spawner.spawn(argv, self._env, fds={1: devnull, 3: theirs.fileno()})
        except OSError as exc:
            self._failures = self.settings.max_failures
            ours.close()
            self.note_cold(f"cannot start the check forkserver: {exc}")
            return None
        finally:
            theirs.close()
            os.close(devnull)
        self.made += 1
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        server = _Server(pid, ours, reader, writer)
        self._spawn_task(self._watch(server), f"check-forkserver-{pid}")
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                server.info = await forking.read_message(reader, "check forkserver")
        except (OSError, TimeoutError, ValueError) as exc:
            server.info = {"event": "broken", "reason": repr(exc)}
        except BaseException:  # closing while it imports
            self._retire(server)
            raise
        if server.info.get("event") != "ready":
            self._failures += 1
            log.warning("check forkserver %s failed (%s)%s", pid, server.info,
                        ": cold starts from now on" if self.disabled else "")  # fmt: skip
            self._retire(server)
            return None
        self._failures = 0
        self.ready_info = dict(server.info)
        log.info("check forkserver %s ready (imports %.2f s)", pid, server.info.get("import_s", 0))
        return server

    def _retire(self, server: _Server) -> None:
        server.gone = True
        server.writer.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)

    async def _watch(self, server: _Server) -> None:
        """Reap the forkserver (through the spawner); replace it if it died unasked."""
        raw = await self._spawner.wait(server.pid)
        forget = getattr(self._spawner, "forget", None)
        if forget is not None:
            forget(server.pid)
        if server.gone or self._closing:
            return
        server.gone = True
        server.writer.close()
        log.warning("check forkserver %s died (raw status %s): replacing it", server.pid, raw)
        self._failures += 1
        self.start()

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
