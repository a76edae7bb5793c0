"""The forkserver: a preloaded, single-threaded interpreter that forks children on request.

The one server loop (:func:`run_server`) behind both warm interpreters: the agent's zygote
(:mod:`aegis.agent.zygote`: the user's modules, one child that it then nurses) and the checks'
forkserver (:mod:`aegis.checks.forkserver`: torch, one child at a time, for ever). Its client,
in the agent, is :mod:`aegis.spawn.forkclient`. It runs inside the user's training processes
(a warm child is a fork of it), so it imports nothing of Aegis and only the standard library.

The protocol, one JSON object per line on the Unix socket on fd ``--fd``:

- server -> agent: ``{"event": "ready", "pid", "threads", "cuda", "import_s", "total", ...}``
  (plus the fields the caller's prewarm adds) or ``{"event": "failed", "reason", ...}`` (then it
  exits);
- agent -> server: a request (its fields are the caller's) with the child's stdout and stderr
  attached (``SCM_RIGHTS``);
- server -> agent: ``{"event": "forked", "pid"}`` or ``{"event": "refused", "reason"}``, then,
  when that child has ended, ``{"event": "exited", "pid", "status": <raw wait status>}``.

The server waits for its child (it is the parent, so the agent's reaper never sees it) before it
reads the next request; a *nanny* server (the zygote) serves one child and exits after it. A
server forks only while it is single-threaded and has not initialised CUDA. The child leads a new
process group, dies with the server (``PR_SET_PDEATHSIG``, so its end is never lost), has
Python's start-up signal dispositions back and its descriptors on 1 and 2.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
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


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
MAX_FDS = 2  # the child's stdout and stderr
_RESET = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
          signal.SIGCHLD, signal.SIGALRM, signal.SIGTTIN, signal.SIGTTOU)  # fmt: skip

Prewarm = Callable[[dict[str, str]], dict[str, Any]]
"""Imports what the children need, given the server's options; the fields to add to the ready
message, or (``"failed": reason`` among them) to the failed one."""


def run_server(
    argv: list[str],
    prewarm: Prewarm,
    *,
    name: bytes,
    child_name: bytes | None = None,
    nanny: bool = False,
) -> tuple[dict[str, str], dict[str, Any]]:
    """A server's life: die with the agent (``--agent PID``), prewarm, say ready (or failed, and
    exit), serve; returns (its options, the request) in a forked child only. ``argv`` holds the
    options in pairs; the child is named ``child_name`` (None: what the interpreter was named)."""
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    die_with(int(options["--agent"]))  # an idle server never outlives its agent
    sock = socket.socket(fileno=int(options["--fd"]))
    child_name = child_name or own_name()
    started = time.monotonic()
    quiet_blas()  # numpy's OpenBLAS (torch loads numpy) would start threads: see above
    fields = prewarm(options)
    failed = fields.pop("failed", None) or unsafe()
    if failed is not None:
        send(sock, event="failed", reason=failed, **fields)
        os._exit(1)
    find_blas()  # once, here: every child inherits it (restore_blas)
    set_name(name)
    send(sock, event="ready", pid=os.getpid(), threads=thread_count(), cuda=cuda_initialized(),
         import_s=round(time.monotonic() - started, 3), total=len(sys.modules),
         **fields)  # fmt: skip
    return options, serve(sock, child_name, nanny=nanny)


def unsafe() -> str | None:
    """Why forking now would be unsafe (a thread, CUDA), or None."""
    if cuda_initialized():
        return "cuda"
    return None if single_threaded() else f"threads={thread_count()}"


def serve(sock: socket.socket, child_name: bytes, *, nanny: bool) -> dict[str, Any]:
    """Fork a child per request, wait for it, report it; return its request in the child only.
    A nanny serves one child: it waits for it, reports its end and exits."""
    while True:
        request, fds = next_request(sock, MAX_FDS)
        if refuse_unless_safe(sock, fds, MAX_FDS):
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            sock.close()
            become_child(fds, parent, child_name)
            return request
        if nanny:
            set_name(b"aegis-nanny")
            die_with(None)  # a warm child outlives its agent as a cold one does
        try:
            nurse(sock, pid, fds)
        finally:
            if nanny:
                os._exit(0)


def nurse(sock: socket.socket, pid: int, fds: list[int]) -> None:
    """In the server after a fork: report the child, wait for it (we alone), report its end."""
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # the child does it too: whoever runs first
    for fd in fds:
        os.close(fd)
    send(sock, event="forked", pid=pid)
    _, raw = os.waitpid(pid, 0)
    send(sock, event="exited", pid=pid, status=raw)


def become_child(fds: list[int], parent: int, name: bytes) -> None:
    """In the forked child: its own process group and name, dying with ``parent``, Python's
    start-up signal dispositions and an empty mask, ``fds`` on 1 and 2."""
    os.setpgid(0, 0)
    set_name(name)
    die_with(parent)
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)


def _prctl(option: int, value: Any) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def set_name(name: bytes) -> None:
    """The process name ``ps``/``psutil`` show (the command line stays the server's)."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]))


def own_name() -> bytes:
    with open("/proc/self/comm", "rb") as comm:
        return comm.read().strip()


def die_with(parent: int | None) -> None:
    """SIGKILL us when ``parent`` ends, at once if it has (None: stop dying with our parent)."""
    _prctl(PR_SET_PDEATHSIG, 0 if parent is None else signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def send(sock: socket.socket, **message: Any) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def next_request(sock: socket.socket, max_fds: int) -> tuple[dict[str, Any], list[int]]:
    """The next whole request line and the descriptors that came with any part of it (they
    ride on the first of a request longer than one read: an environment over 64 KiB, say);
    exits the process when the agent has closed the socket (or is gone)."""
    pending, got = b"", []
    while True:
        data, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
        got += fds
        if not data:
            os._exit(0)
        pending += data
        if pending.endswith(b"\n"):
            request = json.loads(pending)
            return (request if isinstance(request, dict) else {}), got


def refuse_unless_safe(sock: socket.socket, fds: list[int], expected_fds: int) -> bool:
    """Refuse (and close the descriptors) unless a fork is safe now; True when refused."""
    if len(fds) == expected_fds and single_threaded() and not cuda_initialized():
        return False
    send(sock, event="refused", reason=f"threads={thread_count()} fds={len(fds)}")
    for fd in fds:
        os.close(fd)
    return True
