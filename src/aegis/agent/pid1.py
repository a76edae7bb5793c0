"""Tini's signal duties (``src/tini.c``), the same for both agent modes: each of
:data:`FORWARDED_SIGNALS` goes to the command's current process group, SIGTERM starts the
agent's own stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

# What an agent (standalone or under a master) passes on to the command's group as it comes, as
# tini does. SIGTERM is not among them: it stops the agent, which stops the group itself.
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


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
