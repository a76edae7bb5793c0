"""The GPU health watch (seed 003: drain a node before its GPU dies).

While the pod runs, the agent reads its GPUs every ``health_s`` through the gpu check's NVML
port (:class:`aegis.checks.gpu.NvmlReader`, in a daemon thread: NVML calls block) and says the
warning signs it finds (``checks.gpu.health_warnings``: ECC errors, pages or rows pending
retirement or remapping, a failed remapping, a GPU at its slowdown temperature, and a hardware
Xid event heard since the first look: ``checks.xids.XidListener`` keeps listening between looks)
to the master at each look while they stand (a report lost in a failover is made again). The
master drains the node: the job's pods there leave at the next checkpoint, no fault counted,
and the node joins the job's ErrorNodes (``master.node_drains``). A node without NVML
is looked at once, and no more; a look that fails or hangs is logged and the watch goes on, on
its first look too (a GPU whose first NVML call hangs is the one to watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from typing import Any

from aegis.checks import gpu
from aegis.wire import messages as m

log = logging.getLogger(__name__)

Report = Callable[[list[str]], Awaitable[None]]


def said(warnings: list[str]) -> list[str]:
    """The warnings one report carries: the first ``HEALTH_WARNINGS``, each cut to
    ``SHORT_CHARS`` characters (what the wire takes)."""
    return [w[: m.SHORT_CHARS] for w in warnings[: m.HEALTH_WARNINGS]]


LOOK_S = 30.0  # a look at NVML not answered by then is logged as hung (none other meanwhile)
NO_NVML = "no NVML"


async def watch(
    reader: gpu.NvmlReader, report: Report, every_s: float, done: asyncio.Future[int]
) -> None:
    """Look every ``every_s`` until ``done``; ``report`` the warnings of each look that has
    any. Returns at once when ``every_s`` is 0 (off), and when the first look finds no NVML (no
    library or driver: ``read`` gave None). A look that fails (a reader error, a call that
    hangs; NVML gone once it had answered) is logged and the watch goes on: a driver that
    answers again is looked at again. Each look runs in a daemon thread: a hung NVML call never
    holds the agent's exit."""
    if every_s <= 0:
        return
    loop, logged, answered = asyncio.get_running_loop(), None, False
    look: asyncio.Future[gpu.GpuSnapshot | None] | None = None
    while not done.done():
        due = loop.time() + every_s
        if look is None or look.done():  # (one that hangs is waited for, never doubled)
            look = _in_daemon_thread(reader.read)
        waiting: set[asyncio.Future[Any]] = {look, done}
        await asyncio.wait(waiting, timeout=max(every_s, LOOK_S), return_when=FIRST_COMPLETED)
        if done.done():
            return
        snapshot, failed = _outcome(look)
        if failed == NO_NVML and not answered:
            log.info("GPU health watch: %s on this node, nothing to watch", failed)
            return
        answered = answered or snapshot is not None
        warnings = said(gpu.health_warnings(snapshot))
        if (failed or warnings) != logged:
            log.log(logging.WARNING if failed or warnings else logging.INFO, "GPU health: %s",
                    failed or "; ".join(warnings) or "no warning sign")  # fmt: skip
            logged = failed or warnings
        if warnings:
            await report(warnings)
        if (left := due - loop.time()) > 0:
            await asyncio.wait({done}, timeout=left)


def _outcome(look: asyncio.Future[gpu.GpuSnapshot | None]) -> tuple[gpu.GpuSnapshot | None, str]:
    """A look's snapshot, or what went wrong with it ("": nothing)."""
    if not look.done():
        return None, f"a look at NVML has not answered in {LOOK_S:g} s"
    if (error := look.exception()) is not None:
        return None, f"reading NVML failed: {error!r}"
    snapshot = look.result()
    return snapshot, "" if snapshot is not None else NO_NVML


def _in_daemon_thread(
    read: Callable[[], gpu.GpuSnapshot | None],
) -> asyncio.Future[gpu.GpuSnapshot | None]:
    """``read()`` in a daemon thread (``asyncio.to_thread``'s executor threads are waited for
    at the loop's end, with no timeout on Python 3.11: a hung call would hold the agent)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[gpu.GpuSnapshot | None] = loop.create_future()

    def settle(outcome: gpu.GpuSnapshot | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outcome)

    def run() -> None:
        try:
            outcome, error = read(), None
        except Exception as exc:  # told to the watch, which logs it
            outcome, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, outcome, error)

    threading.Thread(target=run, name="gpu-health-look", daemon=True).start()
    return future
