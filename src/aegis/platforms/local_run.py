"""``aegis run`` with its master in this process: embedded NATS, an in-process master and one
local agent per pod, until the job reaches Succeed or Failed. (``aegis run --masters N`` is
``replicated_run``'s; the command line chooses.)"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from aegis.adapters.nats_auth import Authority
from aegis.core import events as ev
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.pace import PaceSettings
from aegis.master.service import MasterService, MasterSettings
from aegis.platforms import job_files, run_settings
from aegis.platforms.local import Hosts, LocalPlatform
from aegis.platforms.master_bootstrap import run_master

# the tests' and benchmarks' names for them
from aegis.platforms.run_settings import RunResult as RunResult  # noqa: PLC0414 (re-exported)
from aegis.platforms.run_settings import RunSettings as RunSettings  # noqa: PLC0414 (re-exported)

log = logging.getLogger(__name__)

Observer = Callable[[JobRunner, LocalPlatform], None]


async def run_local(settings: RunSettings, *, observe: Observer | None = None) -> RunResult:
    """``observe`` is called with the job's runner and platform before the pods start."""
    with run_settings.stop_signals() as stop, run_settings.run_log_dir(settings) as log_dir:
        try:
            return await _run(settings, log_dir, stop, observe)
        except asyncio.CancelledError:
            if (stopped := stop.stopped_error()) is not None:
                raise stopped from None
            raise


async def _run(
    settings: RunSettings, log_dir: Path, stop: run_settings.RunStop, observe: Observer | None
) -> RunResult:
    async with run_settings.run_hosts(settings, log_dir) as (hosts, address, rule):
        master_settings = MasterSettings(
            grpc_host=address,
            creds_ttl_s=settings.creds_ttl_s,
            job=JobSettings(
                heartbeat_timeout_s=settings.heartbeat_timeout_s,
                join_timeout_s=settings.join_timeout_s,
                pace=PaceSettings(settings.pace_window_s, settings.pace_drop),
                rendezvous=rule,
            ),
        )
        authority = None if settings.nats_url else Authority()
        async with run_master(
            master_settings, nats_url=settings.nats_url, authority=authority, server_host=address
        ) as master:
            return await _run_job(settings, master, log_dir, observe, hosts, stop)


async def _run_job(
    settings: RunSettings,
    master: MasterService,
    log_dir: Path,
    observe: Observer | None,
    hosts: Hosts,
    stop: run_settings.RunStop,
) -> RunResult:
    spec = run_settings.job_spec(settings)
    nodes, _ = run_settings.node_names(settings)
    platform = LocalPlatform(run_settings.local_settings(settings, log_dir), hosts)
    runner, token = await master.create_job(
        spec, nodes, platform, log_dir=log_dir, pod_ips=[hosts.address(n) for n in nodes]
    )
    platform.attach(
        runner.platform_event,
        namespace=spec.namespace,
        job=spec.job,
        pods=runner.pod_nodes(),
        master=f"{master.settings.grpc_host}:{master.grpc_port}",
        token=token,
    )
    runner.listeners.append(lambda r, event, actions: platform.turn_slow_at_commit(event))
    stop.attach(lambda reason: runner.platform_event(ev.QuitRequested(reason)))
    stop.on_second(platform.kill_now)
    pids_seen = await _until_done(runner, platform, observe, stop)
    if settings.status_file is not None:
        job_files.write_status_file(settings.status_file, spec, runner.status)
    return RunResult(
        spec=spec,
        status=runner.status,
        log_dir=log_dir,
        placements=[(str(p), n) for p, n in platform.placements],
        agent_pids_seen=pids_seen,
        drops=dict(runner.drops.counts),
        ended=runner.notes.ended,
        stopped_by=stop.stopped_by,
    )


async def _until_done(
    runner: JobRunner, platform: LocalPlatform, observe: Observer | None, stop: run_settings.RunStop
) -> dict[str, list[int]]:
    """Start the pods and wait for the job's end (a stop signal ends it); then stop what is
    left. Returns every agent pid each pod had, first and last."""
    pids_seen: dict[str, list[int]] = {}
    try:
        if observe is not None:
            observe(runner, platform)
        await platform.launch_all()
        for pod, pid in platform.agent_pids().items():
            pids_seen.setdefault(pod, []).append(pid)
        await runner.wait_done()
        stop.ended()
        for pod, pid in platform.agent_pids().items():
            if pid not in pids_seen.setdefault(pod, []):
                pids_seen[pod].append(pid)
    finally:
        await platform.stop_all()
    return pids_seen
