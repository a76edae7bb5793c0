"""A master for one run, with its own NATS server unless the run names one: what ``aegis run``
(``local_run``) and a Slurm job's coordinator (``slurm.coordinator``) both start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aegis.adapters.aio import to_thread_to_its_end
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats
from aegis.master.service import MasterService, MasterSettings


@contextlib.asynccontextmanager
async def run_master(
    settings: MasterSettings,
    *,
    nats_url: str | None,
    authority: Authority | None,
    server_host: str,
    store_dir: Path | None = None,
    advertise: str | None = None,
) -> AsyncIterator[MasterService]:
    """The master, connected to ``nats_url``, or (None) to a server started here on
    ``server_host`` with ``authority``'s keys (and JetStream in ``store_dir``); ``advertise``:
    the address this master reaches that server at, when not the server's own. A server started
    here is started again if it dies (``EmbeddedNats.keep_running``). Everything it started is
    stopped on the way out."""
    server, keeping, master = None, None, None
    try:
        if nats_url is None:  # stopped on the way out even when it fails to start (its keys)
            server = EmbeddedNats(authority, host=server_host, store_dir=store_dir)
            await to_thread_to_its_end(server.start)
            keeping = asyncio.create_task(server.keep_running(), name="nats-server")
            nats_url = f"nats://{advertise}:{server.port}" if advertise else server.url
        master = await MasterService.connect(authority, nats_url, settings)
        yield master
    finally:
        if keeping is not None:
            keeping.cancel()
        if master is not None:
            await master.close()
        if server is not None:
            await asyncio.to_thread(server.stop)
