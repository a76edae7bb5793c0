"""Warm starts: the agent's side of the zygote (:mod:`aegis.agent.zygote`), one per pod.

A :class:`Zygotes` keeps at most one zygote (a warm interpreter, started with the job's
environment) ready for the next start of a Python command; :meth:`Zygotes.fork` hands it the
per-incarnation environment, cwd and output pipes and gets back the new training process's pid
and a future of its raw wait status. The used zygote stays as that process's nanny (the one
process that waits for it) and reports its end; the agent's reaper reaps the nanny. The
supervisor calls :meth:`Zygotes.prepare` once an incarnation has made progress (so a fresh zygote
does not compete with the restarting ranks for CPU) or has ended; a zygote that dies while idle is
replaced. Whatever goes wrong, :meth:`fork` returns None and the caller starts cold.

What is prewarmed (``AEGIS_PREWARM`` / ``--prewarm``): ``auto`` (the default) imports the
modules the script imports (read from its source) plus the packages whose native extensions the
first cold incarnation had mapped when it first reported progress; ``torch,numpy`` imports those
only; ``0`` turns warm starts off.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from aegis import forking
from aegis.agent import pycmd, reaper

log = logging.getLogger(__name__)

ENV_VAR = "AEGIS_PREWARM"
ZYGOTE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
FORK_TIMEOUT_S = 10.0
MAX_FAILURES = 3
_OFF = frozenset({"0", "off", "no", "false", "none"})
_NATIVE = re.compile(r"/(?:site|dist)-packages/([A-Za-z_][A-Za-z0-9_]*)(?:/|\.[^/]*\.so)")


@dataclasses.dataclass(frozen=True, slots=True)
class PrewarmSettings:
    modules: tuple[str, ...] | None = None  # None: auto (the script's imports + native packages)
    prepare_after_s: float = 60.0  # make the next zygote this long after a start without progress
    settle_s: float = 5.0  # ... or this long after the first progress (the start is fragile)
    ready_timeout_s: float = 120.0  # wait this long for a zygote to import its modules


def settings_from(value: str | None) -> PrewarmSettings | None:
    """``--prewarm``/``AEGIS_PREWARM``: unset, ``auto`` or ``1``: auto; ``0``: off; else a list."""
    text = (value or "").strip()
    if text.lower() in _OFF:
        return None
    if text.lower() in ("", "auto", "1", "on", "yes", "true"):
        return PrewarmSettings()
    return PrewarmSettings(modules=tuple(m.strip() for m in text.split(",") if m.strip()))


def native_packages(pids: Iterable[int]) -> set[str]:
    """Top-level installed packages whose shared objects the processes have mapped."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                text = maps.read()
        except OSError:
            continue
        found.update(m.group(1) for m in _NATIVE.finditer(text))
    return found


@dataclasses.dataclass(slots=True, eq=False)
class Zygote:
    pid: int
    sock: socket.socket
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    used: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Forked:
    pid: int
    status: asyncio.Future[int]  # the raw wait status, as the nanny reports it


class Zygotes:
    """Use as ``async with``; see the module docstring."""

    def __init__(
        self,
        command: pycmd.PythonCommand,
        env: Mapping[str, str],
        the_reaper: reaper.Reaper,
        settings: PrewarmSettings,
        stderr_fd: int,
        learn_path: str,
    ) -> None:
        self.command = command
        self.settings = settings
        self._env = dict(env)
        self._reaper = the_reaper
        self._stderr_fd = stderr_fd
        self._next: asyncio.Task[Zygote | None] | None = None
        self._extra: set[str] = set()
        self._excluded: set[str] = set()
        self._failures = 0
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[int, Zygote] = {}  # started and not used (yet)
        self.made = 0  # zygotes started so far
        self.learn_path = learn_path  # where a warm child writes the modules it imported

    @classmethod
    def create(
        cls,
        argv: tuple[str, ...],
        env: Mapping[str, str],
        the_reaper: reaper.Reaper,
        settings: PrewarmSettings,
        stderr_fd: int,
        learn_path: str,
    ) -> Zygotes | None:
        command = pycmd.parse(argv, env)
        if command is None:
            log.warning("cold starts: %s is not 'python script.py' or 'python -m module'", argv[0])
            return None
        return cls(command, env, the_reaper, settings, stderr_fd, learn_path)

    @property
    def disabled(self) -> bool:
        return self._failures >= MAX_FAILURES

    def prepare(self, seen_modules: Iterable[str] = ()) -> None:
        """Start making a zygote unless one is ready or on its way."""
        self._extra.update(seen_modules)
        if self._closing or self.disabled:
            return
        if self._next is None or (self._next.done() and self._next.result() is None):
            self._next = asyncio.create_task(self._make(), name="zygote")

    async def ready(self) -> Zygote | None:
        """The zygote the next fork will use, once it has imported its modules (None: none)."""
        if self._next is None:
            return None
        return await asyncio.shield(self._next)

    async def fork(
        self, env: Mapping[str, str], cwd: str, out_fd: int, err_fd: int
    ) -> Forked | None:
        """Fork the command from a zygote (made now if none is on its way); None: start it cold."""
        if self._next is None:
            self.prepare()
        zygote = await self.ready()
        self._next = None
        if zygote is None:
            return None
        zygote.used = True
        self._live.pop(zygote.pid, None)
        learn = self.learn_path if self.settings.modules is None else ""
        request = {"env": dict(env), "cwd": cwd, "args": list(self.command.args), "learn": learn,
                   "orig_argv": [self.command.interpreter, *self.command.options,
                                 *self._target_argv(), *self.command.args]}  # fmt: skip
        try:
            socket.send_fds(zygote.sock, [json.dumps(request).encode() + b"\n"], [out_fd, err_fd])
            async with asyncio.timeout(FORK_TIMEOUT_S):
                answer = await forking.read_message(zygote.reader, "zygote")
        except (OSError, TimeoutError, ValueError) as exc:
            answer = {"event": "broken", "reason": repr(exc)}
        if answer.get("event") != "forked":
            log.warning("zygote %s did not fork (%s): starting cold", zygote.pid, answer)
            self._retire(zygote)
            return None
        status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._spawn_task(self._nurse_reports(zygote, status), f"nanny-{zygote.pid}")
        return Forked(int(answer["pid"]), status)

    async def close(self) -> None:
        self._closing = True
        if self._next is not None:
            self._next.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._next
        self._next = None
        for zygote in list(self._live.values()):
            self._retire(zygote)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=FORK_TIMEOUT_S)
        for task in self._tasks:
            task.cancel()

    def _target_argv(self) -> list[str]:
        c = self.command
        return ["-m", c.module] if c.module is not None else [str(c.script)]

    def _modules(self) -> list[str]:
        chosen = self.settings.modules
        names = list(chosen) if chosen is not None else sorted(self._extra)
        return [n for n in names if n not in self._excluded]

    async def _make(self) -> Zygote | None:
        """Make a ready zygote, trying again (without a module that broke one) a few times."""
        while not self.disabled:
            zygote = await self._make_one()
            if zygote is not None:
                return zygote
        return None

    async def _make_one(self) -> Zygote | None:
        """Start a zygote and wait until it is ready; None (logged) when it fails."""
        c = self.command
        target = ["--module", c.module] if c.module is not None else ["--script", str(c.script)]
        auto = "1" if self.settings.modules is None else "0"
        argv = [c.interpreter, *c.options, ZYGOTE_PATH, "--fd", "3", "--agent", str(os.getpid()),
                *target, "--modules", ",".join(self._modules()), "--auto", auto,
                "--learned", self.learn_path]  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            pid = self._reaper.spawn(
                argv, self._env, fds={1: devnull, 2: self._stderr_fd, 3: theirs.fileno()}
            )
        except OSError as exc:
            log.warning("cannot start a zygote (%s): cold starts", exc)
            self._failures = MAX_FAILURES
            ours.close()
            return None
        finally:
            theirs.close()
            os.close(devnull)
        self.made += 1
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        zygote = self._live[pid] = Zygote(pid, ours, reader, writer)
        self._spawn_task(self._watch(zygote), f"zygote-{pid}")
        try:
            async with asyncio.timeout(self.settings.ready_timeout_s):
                zygote.info = await forking.read_message(reader, "zygote")
        except (OSError, TimeoutError, ValueError) as exc:
            zygote.info = {"event": "broken", "reason": repr(exc)}
        if zygote.info.get("event") != "ready":
            self._failed(zygote)
            return None
        info = zygote.info
        names = ",".join(info.get("modules", ()))
        log.info("zygote %s ready: %s + %s learned", pid, names, info.get("learned"))
        self._failures = 0
        return zygote

    def _failed(self, zygote: Zygote) -> None:
        info = zygote.info
        self._failures += 1
        module = info.get("module")
        if module:
            self._excluded.add(str(module))
        log.warning("zygote %s failed (%s)%s", zygote.pid, info,
                    "" if not self.disabled else ": cold starts from now on")  # fmt: skip
        self._retire(zygote)

    def _retire(self, zygote: Zygote) -> None:
        zygote.used = True
        self._live.pop(zygote.pid, None)
        zygote.writer.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(zygote.pid, signal.SIGKILL)

    async def _watch(self, zygote: Zygote) -> None:
        """Reap the zygote (through the reaper); replace it if it died while it was waiting."""
        raw = await self._reaper.wait(zygote.pid)
        self._reaper.forget(zygote.pid)
        self._live.pop(zygote.pid, None)
        if zygote.used or self._closing or zygote.info.get("event") != "ready":
            return
        log.warning("idle zygote %s died (status %s): replacing it", zygote.pid,
                    reaper.exit_status(raw))  # fmt: skip
        zygote.used = True
        zygote.writer.close()
        self._failures += 1
        if self._next is not None and self._next.done() and self._next.result() is zygote:
            self._next = None
        self.prepare()

    async def _nurse_reports(self, zygote: Zygote, status: asyncio.Future[int]) -> None:
        try:
            answer = await forking.read_message(zygote.reader, "zygote")
            status.set_result(int(answer["status"]))
        except (OSError, ValueError, KeyError) as exc:
            log.error("nanny %s vanished (%r): its child dies with it (SIGKILL)", zygote.pid, exc)
            status.set_result(signal.SIGKILL)  # the raw wait status of a SIGKILL death
        finally:
            zygote.writer.close()

    def _spawn_task(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
