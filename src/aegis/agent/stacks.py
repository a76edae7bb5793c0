"""Stack dumps of the training processes with py-spy, degrading to an explanation when it can't.

py-spy is started through the reaper (the agent's one owner of ``waitpid``), one process at a time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import psutil

from aegis.agent import ports, reaper

DUMP_TIMEOUT_S = 10.0


def find_py_spy() -> str | None:
    """py-spy next to our interpreter (a venv), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return "?"


async def dump(
    the_reaper: reaper.Reaper, pid: int, *, timeout_s: float = DUMP_TIMEOUT_S
) -> ports.StackDump:
    cmdline = _cmdline(pid)
    exe = find_py_spy()
    if exe is None:
        return ports.StackDump(pid, cmdline, "", "py-spy not found")
    with tempfile.TemporaryFile() as out:
        try:
            spy = the_reaper.spawn(
                [exe, "dump", "--pid", str(pid)],
                os.environ,
                fds={1: out.fileno(), 2: out.fileno()},
            )
        except OSError as exc:
            return ports.StackDump(pid, cmdline, "", f"cannot run py-spy: {exc}")
        error = None
        try:
            async with asyncio.timeout(timeout_s):
                raw = await the_reaper.wait(spy)
        except TimeoutError:
            os.kill(spy, signal.SIGKILL)
            raw = await the_reaper.wait(spy)
            error = f"py-spy timed out after {timeout_s:.0f} s"
        the_reaper.forget(spy)
        out.seek(0)
        text = out.read().decode(errors="replace")
    status = reaper.exit_status(raw)
    if error is None and status != 0:
        first = text.strip().splitlines()[0] if text.strip() else ""
        hint = " (ptrace denied? needs CAP_SYS_PTRACE)" if "ermission" in text else ""
        error = f"py-spy exited {status}: {first}{hint}"
    return ports.StackDump(pid, cmdline, text if error is None else "", error)


async def dump_all(the_reaper: reaper.Reaper, pids: list[int]) -> tuple[ports.StackDump, ...]:
    return tuple([await dump(the_reaper, pid) for pid in pids])
