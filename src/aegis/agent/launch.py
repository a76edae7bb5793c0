"""How the supervisor starts an incarnation: forked from a warm zygote (:mod:`aegis.agent.warm`)
when one is ready, else spawned cold through the reaper; and when the next zygote is made."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence

from aegis.agent import group, incarnation, reaper, warm, watchdog

PREWARM_POLL_S = 0.05


async def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    out_w: int,
    err_w: int,
    the_reaper: reaper.Reaper,
    zygotes: warm.Zygotes | None,
) -> tuple[int, asyncio.Future[int], bool]:
    """Fork the command from a zygote, or spawn it cold: (pid, its raw status, warm)."""
    if zygotes is not None:
        forked = await zygotes.fork(env, os.getcwd(), out_w, err_w)
        if forked is not None:
            return forked.pid, forked.status, True
    pid = the_reaper.spawn(argv, env, fds={1: out_w, 2: err_w})
    return pid, the_reaper.status(pid), False


async def prewarm_when_running(
    zygotes: warm.Zygotes, progress_file: watchdog.ProgressFile, inc: incarnation.Incarnation
) -> None:
    """Make the next zygote once ``inc`` has ended or has run a while since its first progress.

    Not sooner: a zygote importing torch would compete for CPU with the starting ranks and
    with the report of an early crash.
    """
    settings = zygotes.settings
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.prepare_after_s
    while not inc.done.done() and loop.time() < deadline:
        if progress_file.read() is not None:
            deadline = min(deadline, loop.time() + settings.settle_s)
        await asyncio.sleep(PREWARM_POLL_S)
    seen = await asyncio.to_thread(lambda: warm.native_packages(group.member_pids(inc.pid)))
    zygotes.prepare(seen)
