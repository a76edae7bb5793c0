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
