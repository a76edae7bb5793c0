"""What the agent's zygote (:mod:`aegis.agent.zygote`) and the checks' forkserver
(:mod:`aegis.checks.forkserver`) share: a pre-warmed interpreter that forks children on request.

The protocol: one JSON object per line on a Unix socket, with the child's descriptors passed
alongside the request (``SCM_RIGHTS``); the server answers ``refused``, ``forked`` and ``exited``
lines. A server forks only while it is single-threaded and has not initialised CUDA. Outside the
layers on purpose (like :mod:`aegis.training`): the agent and the checks both use it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
from typing import Any


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def single_threaded() -> bool:
    return thread_count() == 1 and threading.active_count() == 1


# numpy's OpenBLAS starts its thread pool as it loads (torch loads numpy as it loads): a server
# that imported torch would not be single-threaded and would never fork (every warm start of a
# job with numpy installed became a cold one). The server loads its modules with a pool of one
# (no thread) and each child sets the pool the job would have had (:func:`restore_blas`).
BLAS_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
_BLAS_SETTERS = (
    "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
    "openblas_set_num_threads64_", "openblas_set_num_threads",
)  # fmt: skip


def quiet_blas() -> None:
    """In the server, before its imports: OpenBLAS with no threads of its own."""
    os.environ["OPENBLAS_NUM_THREADS"] = "1"


def blas_threads(env: dict[str, str] | os._Environ[str]) -> int:
    """The OpenBLAS pool a process with ``env`` gets at start-up: the first of its variables
    set, else one thread per usable core."""
    for name in BLAS_VARS:
        text = env.get(name, "").strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return len(os.sched_getaffinity(0)) or 1


_FOUND_BLAS: list[str | None] = []  # the loaded OpenBLAS, once found (``find_blas``)


def find_blas() -> str | None:
    """The loaded OpenBLAS library's path (None: none is loaded), looked up once: a server calls
    it after its imports, so its children inherit the answer instead of each reading
    ``/proc/self/maps``."""
    if not _FOUND_BLAS:
        libraries = _loaded_libraries()
        _FOUND_BLAS.append(next((p for p in libraries if "openblas" in os.path.basename(p)), None))
    return _FOUND_BLAS[0]


def restore_blas() -> int | None:
    """In a child, with the job's environment: OpenBLAS's pool as a cold start has it (threads
    made after the fork are safe); the size set, or None when no OpenBLAS is loaded."""
    path = find_blas()
    if path is None:
        return None
    import ctypes  # only where OpenBLAS is loaded

    library = ctypes.CDLL(path)
    setter = next((getattr(library, n) for n in _BLAS_SETTERS if hasattr(library, n)), None)
    if setter is None:
        return None
    count = blas_threads(os.environ)
    setter.argtypes = [ctypes.c_int]
    setter(count)
    return count


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:
        return []


def send(sock: socket.socket, **message: Any) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def next_request(sock: socket.socket, max_fds: int) -> tuple[dict[str, Any], list[int]]:
    """The next whole request line and the descriptors that came with its last part; exits
    the process when the agent has closed the socket (or is gone)."""
    pending = b""
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
        if not data:
            os._exit(0)
        pending += data
        if pending.endswith(b"\n"):
            request = json.loads(pending)
            return (request if isinstance(request, dict) else {}), list(fds)
        for fd in fds:
            os.close(fd)


def refuse_unless_safe(sock: socket.socket, fds: list[int], expected_fds: int) -> bool:
    """Refuse (and close the descriptors) unless a fork is safe now; True when refused."""
    if len(fds) == expected_fds and single_threaded() and not cuda_initialized():
        return False
    send(sock, event="refused", reason=f"threads={thread_count()} fds={len(fds)}")
    for fd in fds:
        os.close(fd)
    return True


async def read_message(reader: asyncio.StreamReader, who: str) -> dict[str, Any]:
    """The agent's side: the server's next answer line."""
    line = await reader.readline()
    if not line:
        raise ValueError(f"the {who} closed its socket")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"bad message {line!r}")
    return message
