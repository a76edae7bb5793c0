"""Tini's signal duties (``src/tini.c``), the same for both agent modes: each of
:data:`FORWARDED_SIGNALS` goes to the command's current process group, SIGTERM starts the
agent's own stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator

# What the agent never passes on. SIGTERM stops the agent, which stops the group itself; the
# reaper waits on SIGCHLD; SIGKILL and SIGSTOP cannot be caught. The faults a process raises on
# itself (SIGSEGV, SIGABRT, ...) stay the agent's own crash, and the terminal's job control
# (SIGTSTP, SIGTTIN, SIGTTOU) its own, as with tini. SIGPIPE and SIGXFSZ stay ignored as Python
# sets them: the agent raises them on itself by writing to a closed pipe or past the file size
# limit (the write fails instead), and they are no news for the command.
KEPT_SIGNALS: frozenset[int] = frozenset({
    signal.SIGTERM, signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP,
    signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP, signal.SIGABRT,
    signal.SIGSYS, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGPIPE, signal.SIGXFSZ,
})  # fmt: skip


def forwarded(valid: Iterable[int]) -> tuple[int, ...]:
    """The signals of ``valid`` the agent passes on to the command's group: every one but
    :data:`KEPT_SIGNALS` (SIGINT, SIGHUP, SIGUSR1, SIGALRM, SIGPWR, SIGWINCH, SIGCONT, the
    real-time ones, ...), as tini does: one with no handler would end the agent (not PID 1),
    leaving the command running unsupervised, or be lost (PID 1)."""
    return tuple(sorted(int(sig) for sig in valid if sig not in KEPT_SIGNALS))


FORWARDED_SIGNALS: tuple[int, ...] = forwarded(signal.valid_signals())


@contextlib.contextmanager
def signals(forward: Callable[[int], None], on_sigterm: Callable[[], None]) -> Iterator[None]:
    """In the running event loop: each of :data:`FORWARDED_SIGNALS` goes to ``forward`` (the
    supervisor's ``send_signal``: the command's group, none while no command runs), SIGTERM
    calls ``on_sigterm`` (the agent's own stop: SIGTERM to the group, grace, SIGKILL)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    for sig in FORWARDED_SIGNALS:
        loop.add_signal_handler(sig, forward, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, *FORWARDED_SIGNALS):
            loop.remove_signal_handler(sig)
