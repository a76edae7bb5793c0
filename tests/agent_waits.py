"""Helpers of the agent tests: their scripts, the agent's command, a line read with a deadline,
what is left of a process. Waiting for a condition is ``tests.waits``."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests import waits

BIN = Path(__file__).parent / "bin"
AGENT = [sys.executable, "-m", "aegis.cli.main", "agent"]


def read_line_with(
    proc: subprocess.Popen[bytes],
    marker: str | tuple[str, ...],
    timeout_s: float = waits.DEFAULT_S,
    *,
    stderr: bool = False,
) -> str:
    """Read the process's stdout (or stderr) until a line containing ``marker``; return it."""
    markers = (marker,) if isinstance(marker, str) else marker
    pipe = proc.stderr if stderr else proc.stdout
    assert pipe is not None
    fd = pipe.fileno()
    buffer = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if any(m in line.decode() for m in markers):
                    return line.decode()
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise AssertionError(f"no line with {marker!r} within {timeout_s} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"stdout closed before a line with {marker!r}")
            buffer += chunk


def gone(pid: int) -> bool:
    """No such process, or only a zombie nobody has reaped yet."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def really_gone(pid: int) -> bool:
    return not psutil.pid_exists(pid)


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in process.info["cmdline"] or ()):
            found.append(process)
    return found
