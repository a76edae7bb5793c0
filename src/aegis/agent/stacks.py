"""Stack dumps of the training processes with py-spy, degrading to an explanation when it can't.

py-spy is started through the reaper (the agent's one owner of ``waitpid``), one process at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

from aegis import flight
from aegis.agent import ports, reaper
from aegis.core import suspects

DUMP_TIMEOUT_S = 10.0
FLIGHT_WAIT_S = 3.0  # the processes' flight threads look every flight.POLL_S


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
    cmdline, before = _cmdline(pid), _sched_state(pid)
    exe = find_py_spy()
    if exe is None:
        return _dumped(pid, cmdline, before, "", "py-spy not found")
    with tempfile.TemporaryFile() as out:
        try:
            spy = the_reaper.spawn(
                [exe, "dump", "--pid", str(pid)],
                os.environ,
                fds={1: out.fileno(), 2: out.fileno()},
            )
        except OSError as exc:
            return _dumped(pid, cmdline, before, "", f"cannot run py-spy: {exc}")
        error = None
        try:
            async with asyncio.timeout(timeout_s):
                raw = await the_reaper.wait(spy)
        except TimeoutError:
            os.kill(spy, signal.SIGKILL)
            raw = await the_reaper.wait(spy)
            error = f"py-spy timed out after {timeout_s:.0f} s"
        except asyncio.CancelledError:  # the training restarted or stopped meanwhile: py-spy,
            os.kill(spy, signal.SIGKILL)  # in a group of its own and maybe attached, goes too
            await the_reaper.wait(spy)
            the_reaper.forget(spy)
            raise
        the_reaper.forget(spy)
        out.seek(0)
        text = out.read().decode(errors="replace")
    status = reaper.exit_status(raw)
    if error is None and status != 0:
        said = [line for line in text.strip().splitlines() if line.strip()]
        first = next((line for line in said if line.startswith("Error:")), said[0] if said else "")
        hint = " (ptrace denied? needs CAP_SYS_PTRACE)" if "ermission" in text else ""
        error = f"py-spy exited {status}: {first}{hint}"
    return _dumped(pid, cmdline, before, text if error is None else "", error)


def _dumped(pid: int, cmdline: str, before: str, text: str, error: str | None) -> ports.StackDump:
    """The dump, with the process's state line from its state ``before`` the dump and now."""
    state = suspects.state_line(before, _sched_state(pid))
    return ports.StackDump(pid, cmdline, text, error, state=state)


def _sched_state(pid: int) -> str:
    """The process's scheduler state, ``/proc/PID/stat``'s letter (R, S, D, T, ...); "" when
    it cannot be read (gone, or no procfs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return ""
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and ")"
    return fields[0] if fields else ""


async def dump_all(
    the_reaper: reaper.Reaper, pids: list[int], flight_request: str | None = None
) -> tuple[ports.StackDump, ...]:
    """Every process's stack; with ``flight_request`` (the job records its collectives) also
    each one's flight recorder line, asked for before py-spy pauses them."""
    if flight_request is not None:
        ask_flight(flight_request, pids)
    dumps = [await dump(the_reaper, pid) for pid in pids]
    if flight_request is None:
        return tuple(dumps)
    lines = await read_flight(flight_request, pids)
    return tuple(dataclasses.replace(d, flight=lines.get(d.pid, "")) for d in dumps)


def ask_flight(request: str, pids: list[int]) -> None:
    """Ask the processes' flight threads for a dump: old answers removed, the request touched."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.unlink(flight.dump_path(request, pid))
    try:
        with open(request, "ab"):
            pass
        os.utime(request, ns=(time.time_ns(), time.time_ns()))
    except OSError:
        pass


async def read_flight(
    request: str, pids: list[int], wait_s: float = FLIGHT_WAIT_S
) -> dict[int, str]:
    """The flight recorder line of each process that answered within ``wait_s`` (a process
    that has no process group, or no Python, never does)."""
    deadline = time.monotonic() + wait_s
    lines: dict[int, str] = {}
    while True:
        for pid in pids:
            if pid not in lines and (line := _flight_of(flight.dump_path(request, pid))):
                lines[pid] = line
        if len(lines) == len(pids) or time.monotonic() >= deadline:
            return lines
        await asyncio.sleep(0.1)


def _flight_of(path: str) -> str:
    try:
        with open(path, "rb") as f:
            dump = json.loads(f.read(16 << 20))  # the job's own output: parsed, never trusted
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep
        return ""
    return suspects.flight_line(dump) if isinstance(dump, dict) else ""


def remove_flight_files(request: str) -> None:
    """The request file and every answer left beside it (the agent's clean-up)."""
    folder, name = os.path.split(request)
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder or "."):
            if entry == name or (
                entry.startswith(f"{name}.") and entry.endswith((".json", ".tmp"))
            ):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, entry))
