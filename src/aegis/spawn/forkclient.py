"""The agent's side of a forkserver (:mod:`aegis.forking`): one kept ready, children forked from it.

:class:`ForkServers` starts a forkserver through a :class:`~aegis.spawn.spawner.Spawner` (the
agent's reaper reaps it; the forkserver waits for its own children), waits until it has imported
its modules, and :meth:`ForkServers.fork` then forks a child from it in milliseconds and hands
back its pid and a future of its raw wait status (the forkserver reports it). One child at a
time. A forkserver that fails to start, is not ready in time or refuses a fork is retired and
counted; one that dies while idle is replaced; after ``max_failures`` failures in a row there are
no more (every fork answers None). Whatever goes wrong, :meth:`fork` returns None and the caller
starts its child cold.

Two uses, one client: the agent's warm restarts (:mod:`aegis.agent.warm`, the zygote, a *nanny*
forkserver: one fork each, then it waits for that child, so the next one is made when the
supervisor asks) and the warm checks (:mod:`aegis.checks.host`, a forkserver that serves child
after child and is made again at once when it is lost).
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
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

from aegis.spawn import spawner as spawning

log = logging.getLogger(__name__)

SERVER_FD = 3  # the forkserver's end of the socket, in the forkserver


@dataclasses.dataclass(frozen=True, slots=True)
class ServerSettings:
    name: str  # in the logs and task names: "zygote", "check forkserver"
    ready_timeout_s: float = 60.0  # a forkserver not ready by then is a failure
    fork_timeout_s: float = 10.0  # for an answer to a fork, or for the previous child to end
    max_failures: int = 3  # in a row: then cold starts for good
    nanny: bool = False  # a forkserver serves one child, then waits for it (the zygote)


@dataclasses.dataclass(slots=True, eq=False)
class Server:
    """A forkserver as its client sees it."""

    pid: int
    sock: socket.socket
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # its ready (or failed) line
    used: bool = False  # forked from as a nanny, or retired: it serves no more
    reaped: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Forked:
    pid: int
    status: asyncio.Future[int]  # the raw wait status, as the forkserver reports it


class ForkServers:
    """Keeps one forkserver ready (see the module docstring); :meth:`close` it when done.

    ``command`` is the forkserver's command line, asked afresh for each one made, less the
    ``--fd N --agent PID`` this adds; ``on_failed`` hears the failed message of one that failed.
    """

    def __init__(
        self,
        spawner: spawning.Spawner,
        command: Callable[[], Sequence[str]],
        env: Mapping[str, str],
        settings: ServerSettings,
        *,
        stderr_fd: int | None = None,
        on_failed: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.settings = settings
        self._spawner = spawner
        self._command = command
        self._env = dict(env)
        self._stderr_fd = stderr_fd
        self._on_failed = on_failed
        self._next: asyncio.Task[Server | None] | None = None
        self._lock = asyncio.Lock()  # one child at a time
        self._live: set[Server] = set()  # started, neither used nor reaped
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self.failures = 0  # in a row
        self.made = 0  # forkservers started so far
        self.ready_info: dict[str, Any] = {}  # the last ready message

    @property
    def disabled(self) -> bool:
        return self.failures >= self.settings.max_failures

    def prepare(self) -> None:
        """Start making a forkserver unless one is ready or on its way."""
        if self._closing or self.disabled:
            return
        if self._next is None or (self._next.done() and _usable(self._next) is None):
            self._next = asyncio.create_task(self._make(), name=self.settings.name)

    @property
    def ready_now(self) -> bool:
        """Whether a fork would be served at once (a forkserver ready, no child running)."""
        if self._next is None or not self._next.done() or self._lock.locked():
            return False
        return _usable(self._next) is not None

    async def ready(self) -> Server | None:
        """The forkserver the next fork will use, once it is ready (None: none is on its way)."""
        if self._next is None:
            return None
        server = await asyncio.shield(self._next)
        return None if server is None or server.used else server

    async def fork(self, request: Mapping[str, Any], fds: Sequence[int]) -> Forked | None:
        """Fork a child: ``request`` for the forkserver, ``fds`` its stdout and stderr (ours,
        the caller closes them); None: start it cold."""
        self.prepare()
        try:  # the previous child is still going (being killed): not for long
            async with asyncio.timeout(self.settings.fork_timeout_s):
                await self._lock.acquire()
        except TimeoutError:
            log.warning("%s: the previous child has not ended", self.settings.name)
            return None
        child = None
        try:
            server = await self.ready()
            if server is not None:
                child = await self._request(server, request, fds)
        finally:
            if child is None or self.settings.nanny:
                self._lock.release()  # else when the child has ended
        return child

    async def close(self) -> None:
        self._closing = True
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._next
        self._next = None
        for server in list(self._live):
            self._retire(server)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.settings.fork_timeout_s)
        for task in self._tasks:
            task.cancel()

    async def _request(
        self, server: Server, request: Mapping[str, Any], fds: Sequence[int]
    ) -> Forked | None:
        if self.settings.nanny:  # this one serves nobody else: the next is made when asked
            server.used = True
            self._live.discard(server)
            self._next = None
        try:
            socket.send_fds(server.sock, [json.dumps(request).encode() + b"\n"], list(fds))
            async with asyncio.timeout(self.settings.fork_timeout_s):
                answer = await read_message(server.reader, self.settings.name)
        except (OSError, TimeoutError, ValueError) as exc:
            answer = {"event": "broken", "reason": repr(exc)}
        if answer.get("event") != "forked":
            log.warning("%s %s did not fork (%s): cold start", self.settings.name, server.pid,
                        answer)  # fmt: skip
            self.failures += 1
            self._retire(server)
            if not self.settings.nanny:
                self.prepare()
            return None
        status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        pid = int(answer["pid"])
        self._spawn_task(self._child_exit(server, pid, status), f"{self.settings.name}-{pid}")
        return Forked(pid, status)

    async def _child_exit(self, server: Server, pid: int, status: asyncio.Future[int]) -> None:
        try:
            answer = await read_message(server.reader, self.settings.name)
            status.set_result(int(answer["status"]))
        except (OSError, ValueError, KeyError) as exc:  # the forkserver died: so did the child
            log.warning("%s %s gone while its child %s ran (%r): the child died with it",
                        self.settings.name, server.pid, pid, exc)  # fmt: skip
            status.set_result(signal.SIGKILL)  # the raw wait status of a SIGKILL death
        finally:
            if self.settings.nanny:
                server.writer.close()
            else:
                self._lock.release()

    async def _make(self) -> Server | None:
        """A ready forkserver, trying again (``on_failed`` may change the command) a few times."""
        while not self.disabled and not self._closing:
            server = await self._make_one()
            if server is not None:
                return server
        return None

    async def _make_one(self) -> Server | None:
        """Start a forkserver and wait until it is ready; None (logged) when it fails."""
        name = self.settings.name
        argv = [*self._command(), "--fd", str(SERVER_FD), "--agent", str(os.getpid())]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        devnull = os.open(os.devnull, os.O_WRONLY)
        fds = {1: devnull, SERVER_FD: theirs.fileno()}
        if self._stderr_fd is not None:
            fds[2] = self._stderr_fd
        try:
            pid = self._spawner.spawn(argv, self._env, fds=fds)
        except OSError as exc:
            log.warning("cannot start a %s (%s): cold starts", name, exc)
            self.failures = self.settings.max_failures
            ours.close()
            return None
        finally:
            theirs.close()
            os.close(devnull)
        self.made += 1
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        server = Server(pid, ours, reader, writer)
        self._live.add(server)
        self._spawn_task(self._watch(server), f"{name}-{pid}")
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                server.info = await read_message(reader, name)
        except (OSError, TimeoutError, ValueError) as exc:
            server.info = {"event": "broken", "reason": repr(exc)}
        if server.info.get("event") != "ready":
            self._failed(server)
            return None
        self.failures = 0
        self.ready_info = dict(server.info)
        log.info("%s %s ready in %.2f s (%s modules)", name, pid, server.info.get("import_s", 0),
                 server.info.get("total"))  # fmt: skip
        return server

    def _failed(self, server: Server) -> None:
        self.failures += 1
        if self._on_failed is not None:
            self._on_failed(server.info)
        log.warning("%s %s failed (%s)%s", self.settings.name, server.pid, server.info,
                    ": cold starts from now on" if self.disabled else "")  # fmt: skip
        self._retire(server)

    def _retire(self, server: Server) -> None:
        server.used = True
        self._live.discard(server)
        server.writer.close()
        if not server.reaped:  # else its pid may be another process's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGKILL)

    async def _watch(self, server: Server) -> None:
        """Reap the forkserver (through the spawner); replace it if it died while idle."""
        raw = await self._spawner.wait(server.pid)
        self._spawner.forget(server.pid)
        server.reaped = True
        self._live.discard(server)
        if server.used or self._closing or server.info.get("event") != "ready":
            return
        log.warning("idle %s %s died (raw status %s): replacing it", self.settings.name,
                    server.pid, raw)  # fmt: skip
        server.used = True
        server.writer.close()
        self.failures += 1
        self.prepare()

    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _usable(task: asyncio.Task[Server | None]) -> Server | None:
    """The finished task's forkserver, if it still serves."""
    if task.cancelled() or task.exception() is not None:
        return None
    server = task.result()
    return None if server is None or server.used else server


async def read_message(reader: asyncio.StreamReader, who: str) -> dict[str, Any]:
    """The forkserver's next line."""
    line = await reader.readline()
    if not line:
        raise ValueError(f"the {who} closed its socket")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"bad message {line!r}")
    return message
