"""``aegis run``: embedded NATS, an in-process master and one local agent per pod, until the job
reaches Succeed or Failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aegis.adapters.nats_auth import Authority
from aegis.core import events as ev
from aegis.core.model import JobSpec
from aegis.core.rendezvous import RendezvousRule
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.pace import PaceSettings
from aegis.master.service import MasterService, MasterSettings
from aegis.platforms import emulated
from aegis.platforms.local import Hosts, LocalPlatform, LocalSettings, SharedHost
from aegis.platforms.master_bootstrap import run_master
from aegis.platforms.run_settings import RunResult as RunResult  # noqa: PLC0414 (re-exported)
from aegis.platforms.run_settings import RunSettings as RunSettings  # noqa: PLC0414 (re-exported)
from aegis.platforms.run_settings import node_names as node_names  # noqa: PLC0414 (re-exported)
from aegis.platforms.run_settings import write_status_file as write_status_file  # noqa: PLC0414 (re-exported)
from aegis.tools.follow import FollowedJob

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def run_hosts(
    settings: RunSettings, log_dir: Path
) -> AsyncIterator[tuple[Hosts, str, RendezvousRule]]:
    """Where the run's pods live, the address the master's side listens on, and where rounds
    meet: this host, or (``isolate_nodes``) an emulated cluster, torn down afterwards."""
    if not settings.isolate_nodes:
        yield SharedHost(), "127.0.0.1", RendezvousRule()
        return
    nodes, spares = node_names(settings)
    cluster = emulated.EmulatedCluster([*nodes, *spares], log_dir / ".cluster")
    try:
        await cluster.start()
        yield cluster, cluster.bridge_addr, cluster.rule
    finally:
        await cluster.close()


Observer = Callable[[JobRunner, LocalPlatform], None]
Follower = Callable[[FollowedJob, LocalPlatform], None]


async def run_local(
    settings: RunSettings, *, observe: Observer | None = None, follow: Follower | None = None
) -> RunResult:
    """``observe`` is called with the runner of a job led in this process; ``follow`` with the
    event log's view of a job led by master processes (``masters`` > 1)."""
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="aegis-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    async with run_hosts(settings, log_dir) as (hosts, address, rule):
        if settings.masters > 1:
            from aegis.platforms.replicated_run import ReplicatedRun

            replicated = ReplicatedRun(
                settings, settings.masters, log_dir, metrics_port=settings.metrics_port,
                metrics_addr=settings.metrics_addr, follow=follow, hosts=hosts,
                address=address, rule=rule,
            )  # fmt: skip
            try:
                await replicated.start()
                return await replicated.wait()
            except BaseException:
                await replicated.close()  # nothing it started is left running
                raise
        return await _run_in_process(settings, log_dir, observe, hosts, address, rule)


async def _run_in_process(
    settings: RunSettings,
    log_dir: Path,
    observe: Observer | None,
    hosts: Hosts,
    address: str,
    rule: RendezvousRule,
) -> RunResult:
    master_settings = MasterSettings(
        grpc_host=address,
        creds_ttl_s=settings.creds_ttl_s,
        job=JobSettings(
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            pace=PaceSettings(settings.pace_window_s, settings.pace_drop),
            rendezvous=rule,
        ),
    )
    authority = None if settings.nats_url else Authority()
    async with run_master(
        master_settings, nats_url=settings.nats_url, authority=authority, server_host=address
    ) as master:
        return await _run_job(settings, master, log_dir, observe, hosts)


async def _run_job(
    settings: RunSettings,
    master: MasterService,
    log_dir: Path,
    observe: Observer | None,
    hosts: Hosts,
) -> RunResult:
    spec = JobSpec(
        settings.job, settings.namespace, settings.nodes, settings.max_retry,
        settings.software_restart, settings.repeat_limit,
    )  # fmt: skip
    nodes, spares = node_names(settings)
    platform = LocalPlatform(
        LocalSettings(
            nodes=tuple(nodes),
            spares=tuple(spares),
            command=settings.command,
            log_dir=log_dir,
            inject=settings.inject,
            grace_s=settings.grace_s,
            hang_timeout_s=settings.hang_timeout_s,
            heartbeat_s=settings.heartbeat_s,
            ckpt_dir=settings.ckpt_dir or log_dir / "checkpoints",
            prewarm=settings.prewarm,
            slow_from_start=settings.slow_from_start,
        ),
        hosts,
    )
    runner, token = await master.create_job(
        spec, nodes, platform, log_dir=log_dir, pod_ips=[hosts.address(n) for n in nodes]
    )
    platform.attach(
        runner.platform_event,
        namespace=spec.namespace,
        job=spec.job,
        pods=runner.pod_nodes(),
        grpc_target=f"{master.settings.grpc_host}:{master.grpc_port}",
        token=token,
    )
    pids_seen: dict[str, list[int]] = {}
    loop = asyncio.get_running_loop()

    def quit_on_signal(sig: signal.Signals) -> None:
        log.warning("%s: stopping the job", sig.name)
        runner.platform_event(ev.QuitRequested(f"aegis run got {sig.name}"))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, quit_on_signal, sig)
    runner.listeners.append(lambda r, event, actions: platform.turn_slow_at_commit(event))
    try:
        if observe is not None:
            observe(runner, platform)
        await platform.launch_all()
        for pod, pid in platform.agent_pids().items():
            pids_seen.setdefault(pod, []).append(pid)
        await runner.wait_done()
        for pod, pid in platform.agent_pids().items():
            if pid not in pids_seen.setdefault(pod, []):
                pids_seen[pod].append(pid)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await platform.stop_all()
    result = RunResult(
        spec=spec,
        status=runner.status,
        log_dir=log_dir,
        placements=[(str(p), n) for p, n in platform.placements],
        agent_pids_seen=pids_seen,
        drops=dict(runner.drops.counts),
    )
    if settings.status_file is not None:
        write_status_file(settings.status_file, spec, runner.status)
    return result
