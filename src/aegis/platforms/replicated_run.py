"""``aegis run --masters N``: the local platform with N master replicas in their own processes.

The job is submitted to the status bucket; each replica runs ``aegis master`` (leader election on
the KV); the local platform is served to the leader over NATS (``PlatformServer``), so any
replica can drive it. Killing the leader exercises the takeover path on one machine.

``nats_servers=3`` runs a JetStream cluster of three loopback servers instead of one: the buckets
get three copies, the lease the clustered default (longer than a cluster failover), and every
client (this process, the masters, the agents through their credentials) all three URLs.

The masters keep what an in-process run's observers keep (``faults.jsonl`` and the control file
in the log directory; ``/metrics`` on ``metrics_port + i`` for master i when a port is given);
a view follows the job through the leader's ``events.jsonl`` (``platforms.follow``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from aegis.adapters import lifecycle
from aegis.adapters.aio import to_thread_to_its_end
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats, NatsCluster
from aegis.core import events as ev
from aegis.core.model import JobStatus, PodName, pod_names
from aegis.core.rendezvous import RendezvousRule
from aegis.master import eventlog_writer
from aegis.master.lease import LeaseSettings, default_lease_s, holder_name
from aegis.master.service import STATUS_BUCKET
from aegis.platforms import job_files, run_settings
from aegis.platforms.follow import FollowedJob
from aegis.platforms.local import SLOW, Hosts, LocalPlatform, SharedHost
from aegis.platforms.run_settings import RunResult, RunSettings
from aegis.platforms.served_job import ServedJob
from aegis.spawn.ports import free_port
from aegis.wire import status_json

log = logging.getLogger(__name__)

Follower = Callable[[FollowedJob, LocalPlatform], None]


async def run_replicated(settings: RunSettings, *, follow: Follower | None = None) -> RunResult:
    """The job under ``settings.masters`` master processes; ``follow`` is called with the
    event log's view of the job (``FollowedJob``) and the platform before the pods start."""
    with run_settings.stop_signals() as stop, run_settings.run_log_dir(settings) as log_dir:
        try:
            result = await _run(settings, log_dir, stop, follow)
        except asyncio.CancelledError:
            if (stopped := stop.stopped_error()) is not None:
                raise stopped from None
            raise
        result.stopped_by = stop.stopped_by
        return result


async def _run(
    settings: RunSettings, log_dir: Path, stop: run_settings.RunStop, follow: Follower | None
) -> RunResult:
    async with run_settings.run_hosts(settings, log_dir) as (hosts, address, rule):
        replicated = ReplicatedRun(
            settings, settings.masters, log_dir, metrics_port=settings.metrics_port,
            metrics_addr=settings.metrics_addr, follow=follow, hosts=hosts,
            address=address, rule=rule,
        )  # fmt: skip

        def quit_job(reason: str) -> None:
            served = getattr(replicated, "served", None)
            if served is not None:  # the leader ends the job as it ends one that fails
                served.server.sink(ev.QuitRequested(reason))
            else:  # no job yet: nothing to end but the run itself
                stop.cancel_run()

        def kill_pods() -> None:
            platform = getattr(replicated, "platform", None)
            if platform is not None:  # (none before the run has started its pods' platform)
                platform.kill_now()

        stop.attach(quit_job)
        stop.on_second(kill_pods)
        try:
            await replicated.start()
            stop.ask_again()  # the job is served now: a stop whose cancellation was lost ends it
            await replicated.served.wait()
            stop.ended()  # what is left is taking down what the run started
            return await replicated.finish()
        except BaseException:
            stop.ended()
            await replicated.close()  # nothing it started is left running
            raise


class ReplicatedRun:
    def __init__(  # noqa: PLR0913 (what the run hands its masters, all but three defaulted)
        self,
        settings: RunSettings,
        masters: int,
        log_dir: Path,
        lease_s: float | None = None,
        master_env: dict[str, str] | None = None,
        nats_servers: int = 1,
        metrics_port: int = 0,
        metrics_addr: str = "127.0.0.1",
        follow: Follower | None = None,
        hosts: Hosts | None = None,
        address: str = "127.0.0.1",
        rule: RendezvousRule | None = None,
    ) -> None:
        """``hosts``, ``address``, ``rule``: the pods' hosts (an emulated cluster), the address
        NATS and the masters listen on, and where rounds meet (see ``run_settings.run_hosts``)."""
        self.settings, self.count, self.log_dir = settings, masters, log_dir
        self.hosts: Hosts = hosts or SharedHost()
        self.address, self.rule = address, rule or RendezvousRule()
        self.nats_servers = nats_servers
        self.replicas = min(3, nats_servers)  # the buckets' copies
        self.lease_s = lease_s or default_lease_s(self.replicas)
        self.master_env = {**os.environ, **(master_env or {})}
        self.spec = run_settings.job_spec(settings)
        self.masters: list[subprocess.Popen[bytes]] = []
        self.authority = Authority()
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self.observe = follow
        self._stop_following = asyncio.Event()
        self._following: asyncio.Task[None] | None = None
        self._keeping: asyncio.Task[None] | None = None  # the NATS server, started again if it dies
        self._closed = False

    def metrics_ports(self) -> list[int]:
        """Master i serves ``/metrics`` on the i-th port (none without ``metrics_port``)."""
        return [self.metrics_port + i for i in range(self.count)] if self.metrics_port else []

    async def start(self) -> None:
        self.server: EmbeddedNats | NatsCluster
        if self.nats_servers > 1:
            self.server = NatsCluster(self.authority, self.nats_servers, host=self.address)
        else:
            self.server = EmbeddedNats(self.authority, host=self.address)
        await to_thread_to_its_end(self.server.start)  # a cancelled run stops it
        # (its address once started: a port taken meanwhile was chosen again)
        server = self.server
        self.nats_url = server.urls if isinstance(server, NatsCluster) else server.url
        self._keeping = asyncio.create_task(self.server.keep_running(), name="nats-server")
        auth_file = self.log_dir / ".auth.json"
        self.authority.save(auth_file)
        self.bus = await NatsBus.connect(self.nats_url, self.authority.master_creds(), name="run")
        self.store = await KvStore.open(self.bus, STATUS_BUCKET, replicas=self.replicas)
        nodes, _ = run_settings.node_names(self.settings)
        self.platform = LocalPlatform(
            run_settings.local_settings(self.settings, self.log_dir), self.hosts
        )
        pod_ips = [self.hosts.address(n) for n in nodes]
        self.served = await ServedJob.submit(
            self.bus, self.store, self.spec, nodes, self.platform, pod_ips=pod_ips
        )
        self.job_log_dir = eventlog_writer.job_log_dir(self.log_dir, self.spec)
        eventlog_writer.start_log(  # begun here (the view follows it), the leader appends
            self.job_log_dir, self.spec, nodes, 0.0, self.served.token, pod_ips
        )
        ports = [free_port(self.address) for _ in range(self.count)]
        for index, port in enumerate(ports):
            self.masters.append(self._spawn_master(index, port, auth_file))
        followed = FollowedJob.open(self.job_log_dir / eventlog_writer.EVENTS)
        self.platform.attach(
            self.served.server.sink,
            namespace=self.spec.namespace,
            job=self.spec.job,
            pods=dict(zip(pod_names(self.spec), nodes, strict=True)),
            master=",".join(f"{self.address}:{p}" for p in ports),
            token=self.served.token,
        )
        platform = self.platform
        followed.listeners.append(lambda j, event, actions: platform.turn_slow_at_commit(event))
        if self.observe is not None or any(SLOW in f for f in self.settings.inject.values()):
            if self.observe is not None:
                self.observe(followed, self.platform)
            self._following = asyncio.get_running_loop().create_task(
                followed.follow(self._stop_following), name="follow-events"
            )
        await self.platform.launch_all()

    def _spawn_master(self, index: int, port: int, auth_file: Path) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "aegis",
            "master",
            "--nats",
            self.nats_url,
            "--auth-file",
            str(auth_file),
            "--grpc-port",
            str(port),
            "--grpc-host",
            self.address,
            "--rendezvous-host",
            self.rule.fallback_host,
            "--rendezvous-port-base",
            str(self.rule.port_base),
            "--replica-id",
            f"master-{index}",
            "--lease-s",
            str(self.lease_s),
            "--replicas",
            str(self.replicas),
            "--heartbeat-timeout-s",
            str(self.settings.heartbeat_timeout_s),
            "--join-timeout-s",
            str(self.settings.join_timeout_s),
            "--pace-window-s",
            str(self.settings.pace_window_s),
            "--pace-drop",
            str(self.settings.pace_drop),
            "--log-dir",
            str(self.log_dir),
        ]
        if self.metrics_port:
            argv += ["--metrics-port", str(self.metrics_port + index),
                     "--metrics-host", self.metrics_addr]  # fmt: skip
        out = (self.log_dir / f"master-{index}.log").open("ab")
        try:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=lifecycle.child_env(self.master_env),
            )
        finally:
            out.close()

    async def status(self) -> JobStatus:
        return await self.served.status()

    async def leader(self) -> int | None:
        """The index of the replica holding the lease, if any."""
        with contextlib.suppress(Exception):  # no bucket or no lease yet
            store = await KvStore.existing(self.bus, LeaseSettings().bucket, retry_s=0.0)
            got = await store.get(LeaseSettings().key) if store is not None else None
            holder = holder_name(got[0].decode()) if got is not None else ""
            if holder.startswith("master-"):
                return int(holder.split("-", 1)[1])
        return None

    async def wait(self, poll_s: float = 0.2) -> RunResult:
        await self.served.wait(poll_s=poll_s)
        return await self.finish()

    async def finish(self) -> RunResult:
        try:
            record = await self.served.record()
            status = status_json.from_dict(record)[1]
            self._stop_following.set()
            if self._following is not None:
                try:
                    await self._following  # the lines the leader wrote up to the end
                except Exception:
                    log.exception("following the event log failed")
        finally:
            await self.close()
        if self.settings.status_file is not None:
            job_files.write_status_file(self.settings.status_file, self.spec, status)
        return RunResult(
            spec=self.spec,
            status=status,
            log_dir=self.log_dir,
            placements=[(str(p), n) for p, n in self.platform.placements],
            agent_pids_seen={str(p): [pid] for p, pid in self.platform.agent_pids().items()},
            drops={},
            ended=str(record.get("ended") or ""),
        )

    async def close(self) -> None:
        """Stop everything this run started, whatever state it got to (also after an error);
        once."""
        if self._closed:
            return
        self._closed = True
        if self._following is not None and not self._following.done():
            self._following.cancel()
        if self._keeping is not None:
            self._keeping.cancel()
        try:
            platform = getattr(self, "platform", None)
            if platform is not None:
                await platform.stop_all()
            for proc in self.masters:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in self.masters:
                await asyncio.to_thread(_wait_or_kill, proc)
            bus = getattr(self, "bus", None)
            if bus is not None:
                with contextlib.suppress(Exception):
                    await bus.close()
        finally:  # the server (its directory, the keys) goes whatever failed before
            server = getattr(self, "server", None)
            if server is not None:
                await asyncio.to_thread(server.stop)

    def agent_pids(self) -> dict[PodName, int]:
        return self.platform.agent_pids()


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
