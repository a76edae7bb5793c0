"""allreduce_connect and allreduce_perf: the collective round runs in a child process.

The agent never holds a process group: each check starts ``python -m aegis.checks.collective``
and reads its one-line JSON verdict. When the check's budget runs out, :func:`base.run_one`
cancels the wait and the child is killed (SIGKILL), so a hung collective cannot outlive it.
The child's exit status is not waited for here (the agent's reaper owns ``waitpid``); the verdict
is the JSON line, and a child that dies without one fails the check with its stderr's last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from aegis.checks.base import DEFAULT_BUDGETS_S, CheckSettings, GroupInfo, Outcome
from aegis.core.recovery import CheckType

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def solo_group() -> GroupInfo:
    """A world of one on this machine (``aegis check allreduce_*`` without a group)."""
    return GroupInfo(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())


def collective_argv(mode: str, check: CheckType, settings: CheckSettings) -> list[str]:
    group = settings.group
    assert group is not None
    budget = settings.budgets_s.get(check, DEFAULT_BUDGETS_S[check])
    p = settings.perf
    argv = [
        sys.executable, "-m", "aegis.checks.collective", mode,
        "--rank", str(group.rank), "--world-size", str(group.world_size),
        "--master-addr", group.master_addr, "--master-port", str(group.port_for(check)),
        "--timeout-s", str(budget),
    ]  # fmt: skip
    if mode == "perf":
        argv += [
            "--compute-s", str(p.compute_s), "--window-s", str(p.window_s),
            "--matrix", str(p.matrix), "--pair-mb", str(p.pair_mb),
            "--pair-iterations", str(p.pair_iterations), "--pair-repeats", str(p.pair_repeats),
            "--max-pair-rounds", str(p.max_pair_rounds), "--allreduce-mb", str(p.allreduce_mb),
            "--slow-factor", str(p.slow_factor), "--pair-slow-factor", str(p.pair_slow_factor),
        ]  # fmt: skip
    return argv


async def run_child(argv: Sequence[str]) -> Outcome:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out, err = await proc.communicate()
    except BaseException:  # the budget ran out (cancelled) or we are shutting down
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        with contextlib.suppress(BaseException):  # let the pipes close; never block long
            await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
        raise
    for line in reversed(out.decode(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            data = json.loads(line)
            if isinstance(data, dict) and "passed" in data:
                return Outcome(bool(data["passed"]), str(data.get("result", "")))
    lines = [x for x in err.decode(errors="replace").splitlines() if x.strip()]
    return Outcome(False, f"collective child died without a verdict: {lines[-1] if lines else ''}")


async def allreduce_connect_check(settings: CheckSettings) -> Outcome:
    if settings.group is None:
        return Outcome(True, "not_applicable: no group given", not_applicable=True)
    return await run_child(collective_argv("connect", CheckType.ALLREDUCE_CONNECT, settings))


async def allreduce_perf_check(settings: CheckSettings) -> Outcome:
    if settings.group is None:
        return Outcome(True, "not_applicable: no group given", not_applicable=True)
    return await run_child(collective_argv("perf", CheckType.ALLREDUCE_PERF, settings))
