"""``aegis agent --master ...``: the agent under a master (the supervisor driven by the link).

If the master or NATS does not answer within the connect timeout, the agent says so in one line
and runs the command independently (seed ``RunIndependent``); a refused bootstrap token is a
configuration error: one line, exit status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

from aegis.adapters.grpc.creds import CredsRefused
from aegis.agent import link, reaper, supervisor

log = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2


async def run_linked(
    sup_settings: supervisor.SupervisorSettings,
    link_settings: link.LinkSettings,
    argv: Sequence[str],
) -> int | None:
    """Run under the master; ``None`` means the master is unreachable (run independently)."""
    the_link = link.MasterLink(link_settings)
    try:
        await the_link.connect()
    except link.LinkUnavailable as exc:
        print(
            f"aegis agent: warning: master {link_settings.grpc_target} unreachable ({exc}); "
            "running the command independently, without fault tolerance",
            file=sys.stderr,
            flush=True,
        )
        return None
    except CredsRefused as exc:
        print(f"aegis agent: error: the master refused credentials: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    reaper.become_subreaper()
    env = {**os.environ, **the_link.env()}
    loop = asyncio.get_running_loop()
    async with (
        reaper.Reaper() as the_reaper,
        supervisor.Supervisor(argv, sup_settings, the_reaper, the_link, env=env) as sup,
    ):
        stop_code: list[int] = []

        def on_sigterm() -> None:
            if not the_link.done.done():
                stop_code.append(128 + signal.SIGTERM)
                the_link.done.set_result(128 + signal.SIGTERM)

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        tasks = [
            asyncio.create_task(the_link.beat(), name="heartbeat"),
            asyncio.create_task(the_link.resend(), name="resend"),
            asyncio.create_task(the_link.execute_orders(sup), name="orders"),
        ]
        try:
            code = await _wait_done(the_link, tasks)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await the_link.close()
    return code


async def _wait_done(the_link: link.MasterLink, tasks: list[asyncio.Task[None]]) -> int:
    """The exit code ordered by the master; a crashed link task is logged and re-raised."""
    done_waiter: asyncio.Future[int] = asyncio.ensure_future(the_link.done)
    pending: set[asyncio.Future[object]] = {done_waiter, *tasks}  # type: ignore[arg-type]
    while not the_link.done.done():
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for future in finished:
            error = future.exception() if future is not done_waiter else None
            if error is not None:
                log.error("agent task crashed: %r", error)
                raise error
    return the_link.done.result()
