"""The GPU health watch (seed 003: drain a node before its GPU dies).

While the pod runs, the agent reads its GPUs every ``health_s`` through the gpu check's NVML
port (:class:`aegis.checks.gpu.NvmlReader`, read in a thread: NVML calls block) and says the
warning signs it finds (``checks.gpu.health_warnings``: ECC errors, pages or rows pending
retirement or remapping, a failed remapping, critical Xids, a GPU at its slowdown temperature)
to the master at each look while they stand (a report lost in a failover is made again). The
master drains the node: the job's pods there leave at the next checkpoint, no fault counted,
and the node is kept out of the job's placements (``master.node_drains``). A node without NVML
is looked at once, and no more; on one where NVML answered, a failed look is logged and the
watch goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aegis.checks import gpu
from aegis.wire import messages as m

log = logging.getLogger(__name__)

Report = Callable[[list[str]], Awaitable[None]]


def said(warnings: list[str]) -> list[str]:
    """The warnings one report carries (the first ``HEALTH_WARNINGS``, each cut to a line)."""
    return [w[: m.SHORT_CHARS] for w in warnings[: m.HEALTH_WARNINGS]]


async def watch(
    reader: gpu.NvmlReader, report: Report, every_s: float, done: asyncio.Future[int]
) -> None:
    """Look every ``every_s`` until ``done``; ``report`` the warnings of each look that has
    any. Returns at once when ``every_s`` is 0 (off), and after the first look on a node
    without NVML. Once NVML has answered, a look that fails (NVML gone, a reader error) is
    logged and the watch goes on: a driver that answers again is looked at again."""
    if every_s <= 0:
        return
    loop, logged, answered = asyncio.get_running_loop(), None, False
    while not done.done():
        due = loop.time() + every_s
        try:
            snapshot = await asyncio.to_thread(reader.read)
        except Exception as exc:  # the watch never ends the pod
            snapshot, failed = None, f"reading NVML failed: {exc!r}"
        else:
            failed = "" if snapshot is not None else "no NVML"
        if failed and not answered:
            log.info("GPU health watch: %s on this node, nothing to watch", failed)
            return
        answered = True
        warnings = said(gpu.health_warnings(snapshot))
        if (failed or warnings) != logged:
            log.log(logging.WARNING if failed or warnings else logging.INFO, "GPU health: %s",
                    failed or "; ".join(warnings) or "no warning sign")  # fmt: skip
            logged = failed or warnings
        if warnings:
            await report(warnings)
        left = due - loop.time()
        if left > 0:
            await asyncio.wait({done}, timeout=left)
