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

Warm or cold, a check child runs in ``HostSettings.interpreter``: the job's own where it can run
the checks (:func:`runs_checks`), so that the runtime check and the environment report are
about the job's Python and torch, not the agent's (which may have no torch at all).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import aegis
from aegis import autoprogress
from aegis.spawn import forkclient
from aegis.spawn import spawner as spawning

log = logging.getLogger(__name__)

CHECKS_MODULE = "aegis.checks.collective"
PROBE_TIMEOUT_S = 20.0  # an interpreter's first start on a loaded node (before the ACK)
_PROBE = (
    f"import os, aegis, {CHECKS_MODULE}; print(aegis.__version__, os.path.dirname(aegis.__file__))"
)


def is_agents(interpreter: str) -> bool:
    """Whether ``interpreter`` is the one this agent runs in."""
    return os.path.abspath(interpreter) == os.path.abspath(sys.executable)


def check_env(env: Mapping[str, str], interpreter: str) -> dict[str, str]:
    """``env`` for a check child in ``interpreter``, output unbuffered; another interpreter
    than the agent's reaches the agent's ``aegis`` where it has none of its own
    (:data:`aegis.autoprogress.SITE_DIR` first on ``PYTHONPATH``)."""
    out = {**env, "PYTHONUNBUFFERED": "1"}
    if not is_agents(interpreter):
        theirs = [p for p in env.get(autoprogress.PATH_VAR, "").split(os.pathsep)
                  if p and p != autoprogress.SITE_DIR]  # fmt: skip
        out[autoprogress.PATH_VAR] = os.pathsep.join([autoprogress.SITE_DIR, *theirs])
    return out


async def runs_checks(interpreter: str, env: Mapping[str, str]) -> str | None:
    """Why ``interpreter`` cannot run this agent's checks (it cannot import them: a Python too
    old for Aegis, or none at all; or it has another ``aegis`` of its own, whose checks may not
    take this agent's arguments); None when it can. Run before the agent's reaper starts."""
    try:
        proc = await asyncio.create_subprocess_exec(
            interpreter, "-c", _PROBE, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=check_env(env, interpreter),
        )  # fmt: skip
    except OSError as exc:
        return f"{interpreter} does not start: {exc.strerror or exc}"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"{interpreter} did not import the checks within {PROBE_TIMEOUT_S:.0f} s"
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"{interpreter} cannot import the checks: {last[0]}"
    version, _, where = out.decode(errors="replace").strip().partition(" ")
    if where != os.path.dirname(aegis.__file__) and version != aegis.__version__:
        return f"{interpreter} has aegis {version} of its own ({where}), not this agent's"
    return None


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
        self.env = env = check_env(os.environ if env is None else env, settings.interpreter)
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
        self, args: Sequence[str], fds: Mapping[int, int]
    ) -> tuple[int, asyncio.Future[int]]:
        """Start ``python -m aegis.checks.collective ARGS`` cold, in the host's interpreter,
        through the agent's reaper (the one ``waitpid`` owner in the agent): its pid, and its
        raw wait status to come."""
        argv = [self.settings.interpreter, "-m", CHECKS_MODULE, *args]
        pid = self._spawner.spawn(argv, self.env, fds=fds)
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
