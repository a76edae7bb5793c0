"""The checks that need torch (runtime, allreduce_connect, allreduce_perf): one child per round.

The agent never imports torch and never holds a process group. A :class:`CheckChildRound` starts
one child for all such checks of a check round (``python -m aegis.checks.collective
runtime,connect,perf``: one torch import, one rendezvous, one process group) and hands each check
the JSON verdict line the child prints for it; each check keeps its own budget and duration
(:func:`base.run_one`). The child is forked from the agent's warm check interpreter
(``settings.host``, see :mod:`aegis.checks.host`) when one is ready, else started cold. When a
check's budget runs out, the wait is cancelled and the child is killed (SIGKILL), so a hung
collective cannot outlive it. A child that dies without a verdict fails the check with its
stderr's last line. A cold child's exit status is not waited for here beyond letting its pipes
close; a warm one is the forkserver's child, reaped there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aegis.checks import collective
from aegis.checks import host as check_host
from aegis.checks.base import DEFAULT_BUDGETS_S, CheckSettings, GroupInfo, Outcome
from aegis.core.recovery import CheckType
from aegis.spawn.ports import free_port

log = logging.getLogger(__name__)

MODES: dict[CheckType, str] = {
    CheckType.RUNTIME: "runtime",
    CheckType.ALLREDUCE_CONNECT: "connect",
    CheckType.ALLREDUCE_PERF: "perf",
}
COLLECTIVE = frozenset({CheckType.ALLREDUCE_CONNECT, CheckType.ALLREDUCE_PERF})  # need a group
EXPECT_CUDA = {want: word for word, want in collective.EXPECT_CUDA.items()}  # its flag
EXIT_GRACE_S = 2.0  # a child that gave every verdict gets this long to leave on its own
STDERR_LINES = 20


def solo_group() -> GroupInfo:
    """A world of one on this machine (``aegis check allreduce_*`` without a group)."""
    return GroupInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())


def collective_args(checks: Sequence[CheckType], settings: CheckSettings) -> list[str]:
    """The arguments of ``python -m aegis.checks.collective`` running ``checks`` in order."""
    assert checks and all(c in MODES for c in checks)
    args = [",".join(MODES[c] for c in checks)]
    if CheckType.RUNTIME in checks:
        expect = True if settings.require_gpu else settings.expect_cuda
        args += ["--expect-cuda", EXPECT_CUDA[expect]]
    grouped = [c for c in checks if c in COLLECTIVE]
    if grouped:
        group = settings.group
        assert group is not None
        budget = max(settings.budgets_s.get(c, DEFAULT_BUDGETS_S[c]) for c in grouped)
        args += [
            "--rank", str(group.rank), "--world-size", str(group.world_size),
            "--master-addr", group.master_addr, "--master-port", str(group.port_for(grouped[0])),
            "--timeout-s", str(budget),
        ]  # fmt: skip
    p = settings.perf
    if CheckType.ALLREDUCE_PERF in checks:
        args += [
            "--compute-s", str(p.compute_s), "--window-s", str(p.window_s),
            "--matrix", str(p.matrix), "--pair-mb", str(p.pair_mb),
            "--pair-iterations", str(p.pair_iterations), "--pair-repeats", str(p.pair_repeats),
            "--max-pair-rounds", str(p.max_pair_rounds), "--allreduce-mb", str(p.allreduce_mb),
            "--slow-factor", str(p.slow_factor), "--pair-slow-factor", str(p.pair_slow_factor),
            "--straggler-score", str(p.straggler_score),
        ]  # fmt: skip
    return args


@dataclass(slots=True, eq=False)
class _Child:
    """A running collective child, warm or cold: its verdict lines, its stderr, its end."""

    pid: int
    warm: bool
    stdout: asyncio.StreamReader
    stderr: asyncio.StreamReader
    gone: asyncio.Future[Any]  # done once it has ended (and been reaped)
    transports: list[asyncio.BaseTransport] = field(default_factory=list)
    err_lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_LINES)
    )
    err_task: asyncio.Task[None] | None = None

    def kill(self) -> None:
        if self.gone.done():
            return  # reaped already: the pid may be another process's now
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    async def drain_stderr(self) -> None:
        pending = b""
        while chunk := await self.stderr.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            self.err_lines.extend(t for x in lines if (t := x.decode(errors="replace").strip()))
            pending = pending[-4096:]
        if text := pending.decode(errors="replace").strip():
            self.err_lines.append(text)


class CheckChildRound:
    """The torch checks of one check round, answered by one child (see the module doc)."""

    def __init__(self, settings: CheckSettings, checks: Sequence[CheckType]) -> None:
        self.settings = settings
        self.checks = tuple(checks)
        self.answers: dict[str, dict[str, Any]] = {}  # mode -> its verdict line
        self.child: _Child | None = None
        self._start: asyncio.Task[_Child] | None = None
        self._killed = False

    def start(self) -> None:
        """Start the child (in the background) unless it is started."""
        if self._start is None and self.checks:
            self._start = asyncio.create_task(self._spawn(), name="check-child")

    def start_if_warm(self) -> None:
        """Start the child now if a warm one can be forked at once (it then joins its group
        while the local checks run); a cold start waits for the first of its checks, so that
        its ``import torch`` does not compete with the local checks."""
        host = self.settings.host
        if host is not None and host.ready_now:
            self.start()

    async def verdict(self, check: CheckType) -> Outcome:
        """``check``'s outcome from the child's verdict line; cancelled: the child is killed."""
        mode = MODES[check]
        assert check in self.checks, (check, self.checks)
        self.start()
        assert self._start is not None
        try:
            child = await asyncio.shield(self._start)
            while mode not in self.answers:
                line = await child.stdout.readline()
                if not line:
                    break
                with contextlib.suppress(ValueError):
                    data = json.loads(line)
                    if isinstance(data, dict) and "passed" in data:
                        self.answers[str(data.get("mode", mode))] = data
        except BaseException:  # the budget ran out (cancelled) or we are shutting down
            if mode != MODES[CheckType.RUNTIME] or not COLLECTIVE & set(self.checks):
                self.kill()  # (a slow start that outran runtime's budget is the collectives' still)
            raise
        data = self.answers.get(mode)
        if data is not None:
            return Outcome(bool(data["passed"]), str(data.get("result", "")))
        if child.err_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.err_task), EXIT_GRACE_S)
        last = child.err_lines[-1] if child.err_lines else ""
        return Outcome(False, f"check child died without a verdict: {last}")

    def kill(self) -> None:
        self._killed = True
        if self.child is not None:
            self.child.kill()

    async def close(self) -> None:
        """Let a child that gave every verdict leave, kill any other; wait (bounded) until gone."""
        if self._start is None:
            return
        try:
            child = await asyncio.shield(self._start)  # a start cut short could leave a child
        except asyncio.CancelledError:
            self.kill()  # the child, as soon as it is there (``_spawn`` looks)
            raise
        except Exception as exc:
            log.warning("check child did not start: %r", exc)
            return
        done = all(MODES[c] in self.answers for c in self.checks)
        if not done or self._killed:
            child.kill()
        try:
            async with asyncio.timeout(EXIT_GRACE_S):
                await asyncio.shield(child.gone)
        except TimeoutError:
            child.kill()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(child.gone), EXIT_GRACE_S)
        if child.err_task is not None:
            child.err_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await child.err_task
        for transport in child.transports:
            transport.close()

    async def _spawn(self) -> _Child:
        args = collective_args(self.checks, self.settings)
        host = self.settings.host
        child = await _fork_warm(host, args) if host is not None else None
        if child is None:
            if host is not None:
                host.note_cold("the check forkserver is not usable")
            child = await (_spawn_cold(host, args) if host is not None else _start_cold(args))
        child.err_task = asyncio.create_task(child.drain_stderr(), name=f"stderr-{child.pid}")
        self.child = child
        if self._killed:  # the budget ran out while it was starting
            child.kill()
        return child


async def _spawn_cold(host: check_host.CheckHost, args: Sequence[str]) -> _Child:
    """A cold child under an agent: started and waited for by the agent's reaper."""

    async def spawn(out_w: int, err_w: int) -> Started:
        return host.spawn_cold(args, {1: out_w, 2: err_w})

    child = await _piped(spawn, warm=False)
    assert child is not None
    return child


async def _start_cold(args: Sequence[str]) -> _Child:
    """A cold child with no agent around (``aegis check``): asyncio waits for it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aegis.checks.collective", *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    return _Child(proc.pid, False, proc.stdout, proc.stderr, asyncio.ensure_future(proc.wait()))


async def _fork_warm(host: check_host.CheckHost, args: Sequence[str]) -> _Child | None:
    """Fork the child from the warm check interpreter; None when it cannot (start cold)."""

    async def fork(out_w: int, err_w: int) -> Started:
        warm = await host.fork(args, out_w, err_w)
        return None if warm is None else (warm.pid, warm.exited)

    return await _piped(fork, warm=True)


Started = tuple[int, "asyncio.Future[Any]"] | None


async def _piped(start: Callable[[int, int], Awaitable[Started]], *, warm: bool) -> _Child | None:
    """Start a child with its stdout and stderr on fresh pipes (``start`` gets the write ends,
    closed here afterwards); None when ``start`` says it could not."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        started = await start(out_w, err_w)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    if started is None:
        os.close(out_r)
        os.close(err_r)
        return None
    readers: list[asyncio.StreamReader] = []
    transports: list[asyncio.BaseTransport] = []
    for fd in (out_r, err_r):
        reader, transport = await _pipe_reader(fd)
        readers.append(reader)
        transports.append(transport)
    pid, gone = started
    return _Child(pid, warm, readers[0], readers[1], gone, transports)


async def _pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20, loop=loop)
    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    transport, _ = await loop.connect_read_pipe(lambda: protocol, os.fdopen(fd, "rb", 0))
    return reader, transport


async def run_checks_alone(check: CheckType, settings: CheckSettings) -> Outcome:
    """One such check with a child of its own (``aegis check runtime``, ``aegis check
    allreduce_*``)."""
    if check in COLLECTIVE and settings.group is None:
        return Outcome(True, "not_applicable: no group given", not_applicable=True)
    round_ = CheckChildRound(settings, [check])
    try:
        return await round_.verdict(check)
    finally:
        await round_.close()


async def runtime_check(settings: CheckSettings) -> Outcome:
    """The environment report (:mod:`aegis.checks.env`), from a child: the agent never imports
    torch."""
    return await run_checks_alone(CheckType.RUNTIME, settings)


async def allreduce_connect_check(settings: CheckSettings) -> Outcome:
    return await run_checks_alone(CheckType.ALLREDUCE_CONNECT, settings)


async def allreduce_perf_check(settings: CheckSettings) -> Outcome:
    return await run_checks_alone(CheckType.ALLREDUCE_PERF, settings)
