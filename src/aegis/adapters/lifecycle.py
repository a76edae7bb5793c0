"""Child processes that die with their parent, without ``preexec_fn``.

``preexec_fn`` runs Python between fork and exec, which is unsafe in a process with threads
(gRPC's pollers, asyncio's executors): the child can inherit a lock held by another thread or,
as seen here, gRPC's epoll state. Instead a parent passes ``AEGIS_PARENT_PID`` and starts the
child in a new session (``start_new_session=True``); an Aegis child calls ``die_with_parent``
first thing (parent-death signal, and exit if the parent is already gone). A foreign binary
(nats-server) is wrapped in util-linux's ``setpriv --pdeathsig``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
from collections.abc import Sequence

PARENT_ENV = "AEGIS_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must die with this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent(sig: int = signal.SIGTERM) -> int | None:
    """If started by an Aegis parent, get ``sig`` when it dies (and go now if it is gone);
    returns that parent's pid (None: not started by one)."""
    expected = os.environ.pop(PARENT_ENV, "")
    if not expected.isdigit():
        return None
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != int(expected):  # the parent died before the prctl
        os.kill(os.getpid(), sig)
    return int(expected)


def parent_gone(parent: int | None) -> bool:
    """Whether the Aegis parent :func:`die_with_parent` returned has died (this process was
    given to another since)."""
    return parent is not None and os.getppid() != parent


def pdeath_argv(argv: Sequence[str], sig: str = "KILL") -> list[str]:
    """``argv`` wrapped so that it gets ``sig`` when this process dies (where setpriv exists)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return list(argv)
    return [setpriv, f"--pdeathsig={sig}", "--", *argv]
