"""What the forkserver tests share (tests/test_zygote.py, tests/test_checks_warm.py,
tests/test_forkserver.py, tests/test_spawner_contract.py): the agent's reaper and the other
Spawner, the descriptors and the subreaper a server's children need, a spawner that notes what it
starts, an environment that still imports this checkout's Aegis, and supervisors that start a
command cold and then warm from a zygote."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import pytest

from aegis.agent import ports, reaper, supervisor, warm
from aegis.spawn import spawner as spawning

PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
async def the_reaper() -> AsyncIterator[reaper.Reaper]:
    async with reaper.Reaper() as r:
        yield r


@pytest.fixture(params=["reaper", "local"])
async def any_spawner(request: pytest.FixtureRequest) -> AsyncIterator[spawning.Spawner]:
    """Each Spawner in turn: the agent's reaper, and the one of a process with no reaper."""
    if request.param == "local":
        yield spawning.LocalSpawner()
        return
    async with reaper.Reaper() as r:
        yield r


@pytest.fixture
def devnull() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_WRONLY)
    yield fd
    os.close(fd)


@pytest.fixture
def subreaper() -> Iterator[None]:
    """Orphans of the test's children come to this process (as to an agent) while it runs."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def with_path(*directories: str) -> dict[str, str]:
    """This process's environment with ``directories`` first on PYTHONPATH, the rest kept (a
    server started with it still imports this checkout's Aegis, not the installed one)."""
    rest = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*directories, *([rest] if rest else [])])}


class Recording:
    """A Spawner in front of another that notes the command lines it starts."""

    def __init__(self, inner: spawning.Spawner) -> None:
        self.inner = inner
        self.spawned: list[list[str]] = []

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], *, fds: Mapping[int, int] | None = None
    ) -> int:
        self.spawned.append(list(argv))
        return self.inner.spawn(argv, env, fds=fds)

    async def wait(self, pid: int) -> int:
        return await self.inner.wait(pid)

    def forget(self, pid: int) -> None:
        self.inner.forget(pid)


class Lines:
    """A supervisor's observer: the lines its children printed."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, stream: str, line: bytes) -> None:
        self.seen.append(line.decode().rstrip("\n"))

    def json(self, prefix: str) -> list[dict[str, Any]]:
        found = [line.split(" ", 1)[1] for line in self.seen if line.startswith(prefix + " ")]
        return [json.loads(text) for text in found]


def make(
    argv: list[str],
    the_reaper: reaper.Reaper,
    devnull: int,
    *,
    modules: tuple[str, ...] | None = None,
    env: dict[str, str] | None = None,
    prewarm: bool = True,
) -> tuple[supervisor.Supervisor, ports.RecordingReports, Lines]:
    """A supervisor of ``argv`` that starts it warm from zygotes made at once (``prewarm``)."""
    reports, lines = ports.RecordingReports(), Lines()
    settings = supervisor.SupervisorSettings(
        grace_s=5.0,
        hang_timeout_s=0.0,
        stdout_fd=devnull,
        stderr_fd=devnull,
        prewarm=warm.PrewarmSettings(modules=modules, prepare_after_s=0.0, settle_s=0.0)
        if prewarm
        else None,
    )
    sup = supervisor.Supervisor(argv, settings, the_reaper, reports, env=env, observe=lines)
    return sup, reports, lines


async def cold_then_warm(
    argv: list[str],
    the_reaper: reaper.Reaper,
    devnull: int,
    env: dict[str, str] | None = None,
    prefix: str = "PROBE",
) -> tuple[list[ports.ExitReport], list[dict[str, Any]]]:
    """Run the command cold (no zygote), then warm (first start and restart from zygotes)."""
    reports: list[ports.ExitReport] = []
    seen: list[dict[str, Any]] = []
    for prewarm in (False, True):
        sup, _, lines = make(argv, the_reaper, devnull, env=env, prewarm=prewarm)
        async with sup:
            await sup.start()
            reports.append(await sup.wait())
            if prewarm:
                await sup.restart()
                reports.append(await sup.wait())
        seen.extend(lines.json(prefix))
    return reports, seen
