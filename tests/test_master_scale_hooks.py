"""The hooks behind the master-scale benchmark and the clustered lease: the heartbeat lag
histogram, the lease lengths chosen for one server and for a cluster, and the server lists."""

from __future__ import annotations

from aegis.adapters import memory
from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.nats_text import server_list
from aegis.core.model import JobSpec, initial_status
from aegis.core.phases import Phase
from aegis.master.job_runner import Clocks, JobRunner, JobSettings
from aegis.master.lease import CLUSTER_LEASE_S, SINGLE_SERVER_LEASE_S, LeaseSettings
from aegis.master.metrics import MasterMetrics
from aegis.master.ports import NullPlatform
from aegis.wire import codec
from aegis.wire import messages as m


def _runner(now: float) -> JobRunner:
    spec = JobSpec("hb", "default", 2, 1)
    return JobRunner(
        spec,
        initial_status(spec),
        bus=memory.MemoryBus(),
        store=memory.MemoryStore(),
        platform=NullPlatform(),
        settings=JobSettings(),
        log_dir=None,
        clocks=Clocks(wall=lambda: now),
    )


def _heartbeat(pod: str, ts: float) -> bytes:
    msg = m.Message(job="hb", namespace="default", pod=pod, type=m.MessageType.HEARTBEAT,
                    phase=Phase.RUN_COMMAND, seq=2, ts=ts, data=m.HeartbeatData(7))  # fmt: skip
    return codec.encode(msg)


def _subject(pod: str) -> str:
    return worker_subject(job_subject_prefix("default", "hb"), pod)


def _sample(metrics: MasterMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None
    return value


async def test_heartbeat_lag_is_observed_from_the_agents_timestamp() -> None:
    metrics = MasterMetrics()
    runner = _runner(now=1000.0)
    metrics.attach(runner)
    await runner.on_worker_message(
        _subject("hb-0"), _heartbeat("hb-0", ts=999.7)
    )  # 0.3 s on the way
    await runner.on_worker_message(
        _subject("hb-1"), _heartbeat("hb-1", ts=1000.5)
    )  # a clock ahead: 0
    assert _sample(metrics, "aegis_heartbeat_lag_seconds_count") == 2
    assert abs(_sample(metrics, "aegis_heartbeat_lag_seconds_sum") - 0.3) < 1e-6
    le = {"le": "0.25"}
    below = metrics.registry.get_sample_value("aegis_heartbeat_lag_seconds_bucket", le)
    assert below == 1  # only the clock-ahead one is under 250 ms


async def test_a_heartbeat_of_an_unknown_pod_is_not_observed() -> None:
    metrics = MasterMetrics()
    runner = _runner(now=1000.0)
    metrics.attach(runner)
    await runner.on_worker_message(_subject("hb-9"), _heartbeat("hb-9", ts=999.0))
    assert _sample(metrics, "aegis_heartbeat_lag_seconds_count") == 0
    assert runner.drops.counts["unknown_pod"] == 1


def test_lease_is_short_on_one_server_and_outlives_a_cluster_failover() -> None:
    single, clustered = LeaseSettings.for_replicas(1), LeaseSettings.for_replicas(3)
    assert single.lease_s == SINGLE_SERVER_LEASE_S and single.replicas == 1
    assert clustered.lease_s == CLUSTER_LEASE_S and clustered.replicas == 3
    assert clustered.lease_s > 9.0  # nats-server's longest raft election timeout
    assert LeaseSettings.for_replicas(3, lease_s=20.0).lease_s == 20.0
    # renewals often enough that the first write after a failover renews in time
    assert clustered.renew_every_s <= 1.0
    assert single.renew_every_s == single.lease_s / 3


def test_a_url_may_list_every_server_of_a_cluster() -> None:
    assert server_list("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]
    assert server_list("nats://a:1, nats://b:2,,nats://c:3") == [
        "nats://a:1",
        "nats://b:2",
        "nats://c:3",
    ]
