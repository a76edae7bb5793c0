"""A remote platform's ``NodeDown`` (``aegis run --masters N``: the platform runs beside the
replicas and publishes its events on NATS): the leading replica records the node in the job's
error nodes, once, and counts nothing, even when no replica listened as it was published (a
real nats-server and a real replica)."""

from __future__ import annotations

import secrets

import pytest

from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName
from aegis.master.ports import NullPlatform
from aegis.master.records import submit_job
from aegis.platforms.platform_server import PlatformServer
from aegis.platforms.served_job import ServedJob
from aegis.wire import platform_msgs as pm
from tests.poll_helpers import leads, standalone_master
from tests.waits import async_wait_until


async def _quit_with_node_1_in_the_error_nodes(served: ServedJob) -> None:
    """The job quits; its status keeps node-1 in the error nodes, once, and counts nothing."""
    served.server.sink(ev.QuitRequested("over"))

    async def ended() -> bool:
        return (await served.status()).phase.value == "Failed"

    await async_wait_until(ended, what="the job to end")
    status = await served.status()
    assert [(e.node, e.reason) for e in status.error_nodes] == [("node-1", "its holder exited")]
    assert status.recover_count == 0


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
            await _quit_with_node_1_in_the_error_nodes(served)
        finally:
            await served.close()


async def test_a_node_found_down_while_no_replica_listened_is_recorded_by_the_next_leader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The platform found node-1 down and published it before any replica led the job (as
    during a takeover): the new leader asks for a resend once it listens, and records it.
    Before, that NodeDown reached no one and the node was never blacklisted."""
    async with standalone_master(monkeypatch, poll_s=0.05) as master:
        spec = JobSpec(job="early", namespace="default", worker_num=2, max_retry=1)
        server = PlatformServer(master.bus, NullPlatform(), namespace="default", job="early")
        await server.start()
        heard: list[bytes] = []

        async def witness(subject: str, payload: bytes) -> None:
            heard.append(payload)

        events = await master.bus.subscribe(pm.subject("default", "early", "events"), witness)
        server.sink(ev.NodeDown(NodeName("node-1"), "its holder exited"))
        await async_wait_until(lambda: len(heard) == 1, what="the NodeDown published")
        assert "default.early" not in master.replica.runners  # no replica knows the job yet
        token = secrets.token_urlsafe(24)
        await submit_job(master.store, spec, ["node-0", "node-1"], token)
        served = ServedJob(master.store, spec, server, token)
        try:

            async def recorded() -> bool:
                return bool((await served.status()).error_nodes)

            await async_wait_until(recorded, 30, "node-1 in the error nodes")
            await async_wait_until(lambda: len(heard) == 2, what="the resend heard")
            await _quit_with_node_1_in_the_error_nodes(served)
        finally:
            await events.unsubscribe()
            await served.close()
