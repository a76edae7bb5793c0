"""The warm check interpreter: forks collective check children that have torch imported already.

The agent starts it (through its reaper) as ``python -m aegis.checks.forkserver --fd N --agent
PID`` in a process group of its own; it dies with the agent. It imports torch,
``torch.distributed`` and :mod:`aegis.checks.collective`, checks that it is still single-threaded
and has not initialised CUDA, and then serves the agent over the socket on fd N, one JSON object
per line:

- forkserver -> agent: ``{"event": "ready", "pid", "threads", "cuda", "import_s"}`` or
  ``{"event": "failed", "reason"}`` (then it exits);
- agent -> forkserver: ``{"argv": [collective arguments]}`` with two descriptors attached (the
  child's stdout and stderr);
- forkserver -> agent: ``{"event": "forked", "pid"}`` or ``{"event": "refused", "reason"}``, then,
  when that child has ended, ``{"event": "exited", "pid", "status": <raw wait status>}``.

One child at a time: the forkserver waits for it (it is the child's parent, so the agent's reaper
never sees it) before it reads the next request. The child leads a new process group, dies with
the forkserver (``PR_SET_PDEATHSIG``), gets Python's start-up signal dispositions back and runs
:func:`aegis.checks.collective.main`, exactly what ``python -m aegis.checks.collective`` runs.
The forkserver itself never creates a thread, a process group (torch.distributed) or a CUDA
context, so every fork is safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

from aegis.forking import (
    cuda_initialized,
    next_request,
    quiet_blas,
    refuse_unless_safe,
    send,
    single_threaded,
    thread_count,
)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
FDS = 2
_RESET = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
          signal.SIGCHLD, signal.SIGALRM, signal.SIGTTIN, signal.SIGTTOU)  # fmt: skip


def _prctl(option: int, value: Any) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def die_with(parent: int) -> None:
    """SIGKILL us when ``parent`` ends (and at once if it has ended already)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


def prewarm() -> str | None:
    """Import what a collective child needs; the reason it is unsafe to fork from us, or None."""
    quiet_blas()  # numpy's OpenBLAS (torch loads numpy) would start threads: see forking
    try:
        import torch
        import torch.distributed  # noqa: F401

        from aegis.checks import collective  # noqa: F401
    except BaseException as exc:  # torch that does not import: the agent starts children cold
        return f"import failed: {type(exc).__name__}: {exc}"
    if not single_threaded():
        return f"threads={thread_count()} after the imports"
    if cuda_initialized():
        return "CUDA initialised by the imports"
    return None


def become_child(fds: list[int], parent: int) -> None:
    os.setpgid(0, 0)
    _prctl(PR_SET_NAME, ctypes.c_char_p(b"aegis-check"))
    die_with(parent)
    for sig in _RESET:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)


def run_child(argv: list[str]) -> int:
    """In the forked child: what ``python -m aegis.checks.collective ARGV`` runs."""
    from aegis.checks import collective

    sys.argv[:] = ["-m", *argv]
    try:
        code = collective.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def serve(sock: socket.socket) -> list[str]:
    """Fork a child per request and wait for it; returns (in the child only) its arguments."""
    parent = os.getpid()
    while True:
        request, fds = next_request(sock, FDS)
        if refuse_unless_safe(sock, fds, FDS):
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            become_child(fds, parent)
            return [str(a) for a in request["argv"]]
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # the child does it too: whoever runs first
        for fd in fds:
            os.close(fd)
        send(sock, event="forked", pid=pid)
        _, raw = os.waitpid(pid, 0)
        send(sock, event="exited", pid=pid, status=raw)


def main(argv: list[str]) -> int:
    options = dict(zip(argv[::2], argv[1::2], strict=False))
    die_with(int(options["--agent"]))
    sock = socket.socket(fileno=int(options["--fd"]))
    started = time.monotonic()
    reason = prewarm()
    if reason is not None:
        send(sock, event="failed", reason=reason)
        return 1
    _prctl(PR_SET_NAME, ctypes.c_char_p(b"aegis-checkhost"))
    send(sock, event="ready", pid=os.getpid(), threads=thread_count(), cuda=cuda_initialized(),
         import_s=round(time.monotonic() - started, 3))  # fmt: skip
    child_argv = serve(sock)
    return run_child(child_argv)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # a child: no lingering gloo threads at interpreter exit
