"""A remote platform's ``NodeDown`` (``aegis run --masters N``: the platform runs beside the
replicas and publishes its events on NATS): the leading replica records the node in the job's
error nodes, once, and counts nothing (a real nats-server and a real replica)."""

from __future__ import annotations

import pytest

from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName
from aegis.master.ports import NullPlatform
from aegis.platforms.served_job import ServedJob
from tests.poll_helpers import leads, standalone_master
from tests.waits import async_wait_until


async def test_a_node_the_platform_finds_down_joins_the_error_nodes_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with standalone_master(monkeypatch, poll_s=0.05) as master:
        spec = JobSpec(job="nd", namespace="default", worker_num=2, max_retry=1)
        served = await ServedJob.submit(
            master.bus, master.store, spec, ["node-0", "node-1"], NullPlatform()
        )
        try:
            await async_wait_until(lambda: leads(master, "default.nd"), what="nd adopted")
            served.server.sink(ev.NodeDown(NodeName("node-1"), "its holder exited"))
            served.server.sink(ev.NodeDown(NodeName("node-1"), "its holder exited"))

            async def recorded() -> bool:
                return bool((await served.status()).error_nodes)

            await async_wait_until(recorded, what="node-1 in the error nodes")
            served.server.sink(ev.QuitRequested("over"))

            async def ended() -> bool:
                return (await served.status()).phase.value == "Failed"

            await async_wait_until(ended, what="the job to end")
            status = await served.status()
            assert [(e.node, e.reason) for e in status.error_nodes] == [
                ("node-1", "its holder exited")
            ]
            assert status.recover_count == 0
        finally:
            await served.close()
