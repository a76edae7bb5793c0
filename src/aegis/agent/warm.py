"""Warm starts: the agent's side of the zygote (:mod:`aegis.agent.zygote`), one per pod.

A :class:`Zygotes` keeps at most one zygote (a warm interpreter, started with the job's
environment; :class:`aegis.spawn.forkclient.ForkServers` as a *nanny*) ready for the next start
of a Python command; :meth:`Zygotes.fork` hands it the per-incarnation environment, cwd and
output pipes and gets back the new training process's pid and a future of its raw wait status.
The used zygote stays as that process's nanny (the one process that waits for it) and reports
its end; the agent's reaper reaps the nanny. The supervisor calls :meth:`Zygotes.prepare` once an
incarnation has made progress (so a fresh zygote does not compete with the restarting ranks for
CPU) or has ended; a zygote that dies while idle is replaced. Whatever goes wrong, :meth:`fork`
returns None and the caller starts cold.

What is prewarmed (``AEGIS_PREWARM`` / ``--prewarm``): ``auto`` (the default) imports the
modules the script imports (read from its source) plus the packages whose native extensions the
first cold incarnation had mapped when it first reported progress; ``torch,numpy`` imports those
only; ``0`` turns warm starts off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from aegis.agent import pycmd, reaper
from aegis.core.errors import AegisError
from aegis.spawn import forkclient

log = logging.getLogger(__name__)

ENV_VAR = "AEGIS_PREWARM"
ZYGOTE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
FORK_TIMEOUT_S = 10.0
MAX_FAILURES = 3
_OFF = frozenset({"0", "off", "no", "false", "none"})
_MODULE = re.compile(r"[^\W\d]\w*(?:\.[^\W\d]\w*)*")  # a dotted Python name
_NATIVE = re.compile(r"/(?:site|dist)-packages/([A-Za-z_][A-Za-z0-9_]*)(?:/|\.[^/]*\.so)")


@dataclasses.dataclass(frozen=True, slots=True)
class PrewarmSettings:
    modules: tuple[str, ...] | None = None  # None: auto (the script's imports + native packages)
    prepare_after_s: float = 60.0  # make the next zygote this long after a start without progress
    settle_s: float = 5.0  # ... or this long after the first progress (the start is fragile)
    ready_timeout_s: float = 120.0  # wait this long for a zygote to import its modules


class PrewarmError(AegisError, ValueError):
    """``--prewarm`` names something that is no module name (a module that is not there is
    only known in the zygote, which may run another interpreter: it is skipped there)."""


def settings_from(value: str | None) -> PrewarmSettings | None:
    """``--prewarm``/``AEGIS_PREWARM``: unset, ``auto`` or ``1``: auto; ``0``: off; else a list
    of modules, comma-separated (``PrewarmError`` if one is no dotted Python name)."""
    text = (value or "").strip()
    if text.lower() in _OFF:
        return None
    if text.lower() in ("", "auto", "1", "on", "yes", "true"):
        return PrewarmSettings()
    modules = tuple(m.strip() for m in text.split(",") if m.strip())
    for name in modules:
        if not _MODULE.fullmatch(name):
            raise PrewarmError(f"not a module name: {name!r} (give auto, 0, or modules "
                               "separated by commas, e.g. torch,numpy)")  # fmt: skip
    return PrewarmSettings(modules=modules)


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
        self._extra: set[str] = set()
        self._excluded: set[str] = set()
        self.learn_path = learn_path  # where a warm child writes the modules it imported
        server = forkclient.ServerSettings(
            name="zygote",
            ready_timeout_s=settings.ready_timeout_s,
            fork_timeout_s=FORK_TIMEOUT_S,
            max_failures=MAX_FAILURES,
            nanny=True,
        )
        self._servers = forkclient.ForkServers(
            the_reaper, self._argv, env, server, stderr_fd=stderr_fd, on_failed=self._failed
        )

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
        command = pycmd.warm_command(argv, env)
        if command is None:
            log.warning("cold starts: %s is not 'python script.py' (a source file) or "
                        "'python -m module'", shlex.join(argv[:3]))  # fmt: skip
            return None
        return cls(command, env, the_reaper, settings, stderr_fd, learn_path)

    @property
    def made(self) -> int:
        """Zygotes started so far."""
        return self._servers.made

    def prepare(self, seen_modules: Iterable[str] = ()) -> None:
        """Start making a zygote unless one is ready or on its way."""
        self._extra.update(seen_modules)
        self._servers.prepare()

    async def ready(self) -> forkclient.Server | None:
        """The zygote the next fork will use, once it has imported its modules (None: none)."""
        return await self._servers.ready()

    async def fork(
        self, env: Mapping[str, str], cwd: str, out_fd: int, err_fd: int
    ) -> forkclient.Forked | None:
        """Fork the command from a zygote (made now if none is on its way); None: start it cold."""
        c = self.command
        learn = self.learn_path if self.settings.modules is None else ""
        target = ["-m", c.module] if c.module is not None else [str(c.script)]
        request = {"env": dict(env), "cwd": cwd, "args": list(c.args), "learn": learn,
                   "orig_argv": [c.interpreter, *c.options, *target, *c.args]}  # fmt: skip
        return await self._servers.fork(request, [out_fd, err_fd])

    async def close(self) -> None:
        await self._servers.close()

    def _argv(self) -> list[str]:
        """The next zygote's command line: without the modules that broke one."""
        c = self.command
        target = ["--module", c.module] if c.module is not None else ["--script", str(c.script)]
        chosen = self.settings.modules
        names = list(chosen) if chosen is not None else sorted(self._extra)
        modules = [n for n in names if n not in self._excluded]
        auto = "1" if chosen is None else "0"
        return [c.interpreter, *c.options, ZYGOTE_PATH, *target, "--modules", ",".join(modules),
                "--auto", auto, "--learned", self.learn_path]  # fmt: skip

    def _failed(self, info: Mapping[str, Any]) -> None:
        module = info.get("module")
        if module:
            self._excluded.add(str(module))
