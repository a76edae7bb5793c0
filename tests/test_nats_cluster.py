"""A 3-node JetStream cluster on loopback: three real ``nats-server`` processes (routes between
them, operator-mode auth, R3 buckets), two real master replicas, real agents and a real 3-rank
gloo job. The server the leading master is connected to is SIGKILLed while it leads the job's
buckets; the job must finish with exactly the counts one master on one server would have
produced, and the lease must outlive the cluster's own failover."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import NatsCluster
from aegis.core.phases import Phase
from aegis.master.lease import CLUSTER_LEASE_S, LeaseSettings
from aegis.master.service import STATUS_BUCKET
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun
from tests.waits import async_wait_until

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


async def _stream_leader(bus: NatsBus, stream: str) -> str | None:
    try:
        info = await bus.client.jetstream(timeout=1.0).stream_info(stream)
    except Exception:  # electing a leader
        return None
    return info.cluster.leader if info.cluster else None


async def _move_leader(bus: NatsBus, stream: str, server_name: str) -> None:
    """Ask the stream's leader to step down in favour of ``server_name`` (nats-server 2.11+)."""

    async def there() -> bool:
        if await _stream_leader(bus, stream) == server_name:
            return True
        request = json.dumps({"placement": {"preferred": server_name}}).encode()
        try:
            await bus.client.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, 2.0)
        except Exception:  # a stepdown already in progress: ask again
            return False
        return await _stream_leader(bus, stream) == server_name

    await async_wait_until(there, 30, f"{stream} led by {server_name}")


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[NatsCluster, Authority]]:
    authority = Authority()
    servers = NatsCluster(authority, 3)
    await asyncio.to_thread(servers.start)
    try:
        yield servers, authority
    finally:
        await asyncio.to_thread(servers.stop)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.timing
async def test_cluster_buckets_have_three_copies_and_survive_a_server(
    cluster: tuple[NatsCluster, Authority],
) -> None:
    servers, authority = cluster
    bus = await NatsBus.connect(servers.urls, authority.master_creds(), name="probe")
    try:
        store = await KvStore.open(bus, "probe", replicas=3)
        revision = await store.put("k", b"1", expected_revision=None)
        info = await bus.client.jetstream().stream_info("KV_probe")
        assert info.config.num_replicas == 3
        leader = info.cluster.leader if info.cluster else None
        assert leader is not None
        served = servers.index_of_client("probe")
        assert served is not None
        await _move_leader(bus, "KV_probe", f"aegis-{served}")
        servers.servers[served].kill()  # the client's server and the bucket's leader
        revision = await store.put("k", b"2", expected_revision=revision)  # retried through it
        assert await store.get("k") == (b"2", revision)
        assert servers.index_of_client("probe") not in (None, served)  # reconnected elsewhere
    finally:
        await bus.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_bucket_opened_before_the_cluster_has_a_quorum_is_made_once_it_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run's start failed in CI: creating its R3 bucket timed out once (2 s) while the
    cluster's JetStream could not answer, and the open gave up. It now asks again until
    ``retry_s``: here one server of three runs (no quorum) until the open has failed once."""
    authority = Authority()
    servers = NatsCluster(authority, 3)
    try:
        first = servers.servers[0]
        first.launch()
        bus = await NatsBus.connect(first.url, authority.master_creds(), name="early")
        try:
            caplog.set_level(logging.WARNING, logger="aegis.adapters.nats_bus")
            opening = asyncio.create_task(KvStore.open(bus, "early", replicas=3, retry_s=90))

            def failed_once() -> bool:
                assert not opening.done(), opening  # it gave up: the bug
                return "kv early: opening failed" in caplog.text

            await async_wait_until(failed_once, 30, "the open to fail without a quorum")
            for server in servers.servers[1:]:
                server.launch()
            store = await asyncio.wait_for(opening, 90)
            revision = await store.put("k", b"1", expected_revision=None)
            assert await store.get("k") == (b"1", revision)
            info = await bus.client.jetstream().stream_info("KV_early")
            assert info.config.num_replicas == 3
        finally:
            await bus.close()
    finally:
        await asyncio.to_thread(servers.stop)


def _settings(tmp_path: Path) -> RunSettings:
    command = (
        sys.executable,
        str(TRAIN),
        "--steps",
        "120",
        "--ckpt-every",
        "5",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--step-time-s",
        "0.05",
        "--crash-at-step",
        "30",
        "--crash-rank",
        "1",
    )
    return RunSettings(
        command=command,
        nodes=3,
        spare_nodes=1,
        max_retry=2,
        job="ha3",
        heartbeat_timeout_s=4.0,
        grace_s=3.0,
        log_dir=tmp_path,
    )


@pytest.mark.slow
@pytest.mark.timeout(300)  # loaded: three servers, two masters, a restart
@pytest.mark.timing
async def test_killing_the_leaders_server_loses_and_double_counts_nothing(
    tmp_path: Path,
) -> None:
    run = ReplicatedRun(_settings(tmp_path), 2, tmp_path, nats_servers=3)
    assert run.lease_s == CLUSTER_LEASE_S  # longer than the cluster's own failover
    try:
        await run.start()
        assert isinstance(run.server, NatsCluster)
        servers = run.server
        state: dict[str, int | None] = {}

        async def leading_in_run_command() -> bool:
            state["leader"] = await run.leader()
            phase = (await run.status()).phase
            return phase is Phase.RUN_COMMAND and state["leader"] is not None

        await async_wait_until(leading_in_run_command, 90, "RUN_COMMAND with a leader")
        leader = state["leader"]
        assert leader is not None
        served = servers.index_of_client(f"master-{leader}")
        assert served is not None
        # The worst server to lose: the leading master's own, leading both of its buckets.
        for stream in (f"KV_{STATUS_BUCKET}", f"KV_{LeaseSettings().bucket}"):
            await _move_leader(run.bus, stream, f"aegis-{served}")
        agents = run.agent_pids()
        servers.servers[served].kill()

        async def reconnected() -> bool:
            return servers.index_of_client(f"master-{leader}") not in (None, served)

        await async_wait_until(reconnected, 30, "the leading master on a surviving server")
        result = await run.wait()
    finally:
        for proc in run.masters:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        await asyncio.to_thread(run.server.stop)
    assert result.status.phase is Phase.SUCCEED
    assert result.status.recover_count == 1  # the crash of rank 1, counted once
    assert [i.retries for _, i in sorted(result.status.pod_infos.items())] == [1, 1, 1]
    assert run.agent_pids() == agents  # no pod replaced because of the lost server
    logs = [(tmp_path / f"master-{i}.log").read_text() for i in range(2)]
    assert "leads job default.ha3" in logs[leader]
    assert all("lost the lead" not in text and "deposed" not in text for text in logs)
