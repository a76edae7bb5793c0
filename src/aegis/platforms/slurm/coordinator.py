"""``aegis slurm coordinator``: runs inside the batch step of an allocation.

Like ``aegis run`` but with ``SlurmPlatform``: an embedded NATS server (its JetStream store under
the state directory, so it survives a requeue) or ``--nats URL``, the master, one ``srun`` step
per pod. The first ``nodes`` allocated nodes carry the pods, the rest are spares.

With ``--master HOST:PORT[,HOST:PORT]`` (and ``--nats``, ``--auth-file``) the job goes to an
``aegis master`` that is already running (one for many allocations, with its replicas): the
coordinator starts no master and no NATS server; it submits the job to the master's store,
serves it this allocation (``ServedJob``: the master's requests to replace, evict or drain come
over NATS) and waits for the job's end in the store.

Requeue: Slurm restarts the batch script (``SLURM_RESTART_COUNT`` > 0) when the allocation is
lost. Each attempt is a job of its own in the store (``<job>``, ``<job>-r1``, ...); a new attempt
reads the previous attempt's status from the store and starts with what is left of the fault
budget (``max_retry - recover_count``; after an in-place restart every pod's retries equal
``recover_count``, so the job fails after exactly as many further faults as it would have).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aegis.adapters.nats_auth import Authority, UserCreds
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.ports import StatusStore, StoreConflictError
from aegis.core.model import JobSpec, JobStatus, pod_names
from aegis.core.phases import Phase
from aegis.core.rendezvous import TORCH_PORT, RendezvousRule
from aegis.master import control
from aegis.master.job_runner import JobSettings, status_key
from aegis.master.service import STATUS_BUCKET, MasterService, MasterSettings
from aegis.platforms import job_files
from aegis.platforms.master_bootstrap import run_master
from aegis.platforms.process_pods import pod_settings
from aegis.platforms.served_job import ServedJob
from aegis.platforms.slurm import commands
from aegis.platforms.slurm.platform import SlurmPlatform, SlurmSettings
from aegis.wire import status_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    command: tuple[str, ...]
    job: str
    nodes: int
    max_retry: int
    state_dir: Path
    namespace: str = "default"
    # How agents reach this host (grpc and the embedded NATS listen on all addresses); a
    # loopback address means the batch host's node name (see advertised()).
    advertise: str = "127.0.0.1"
    nats_url: str | None = None
    hang_timeout_s: float | None = None  # None: each agent calibrates; 0: off
    health_s: float = 30.0  # between the agents' looks at their GPUs (0: none; agent.health)
    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 600.0  # a pod sent away and not back by then goes elsewhere
    grace_s: float = 5.0
    status_file: Path | None = None
    inject: Mapping[str, frozenset[str]] = field(default_factory=dict)
    master: str | None = None  # an existing aegis master's credentials server(s), HOST:PORT,...
    auth_file: Path | None = None  # that master's keys (aegis master --auth-file), if NATS has auth
    partition: str | None = None  # of a requested node (default: the allocation's partition)
    holder_options: tuple[str, ...] = ()  # a requested node's resources (default: the allocation's)


@dataclass(frozen=True, slots=True)
class CoordinatorResult:
    spec: JobSpec
    status: JobStatus
    placements: list[tuple[str, str]]
    drained: list[tuple[str, str]]

    @property
    def exit_code(self) -> int:
        return 0 if self.status.phase is Phase.SUCCEED else 1


def attempt_job(job: str, attempt: int) -> str:
    return job if attempt == 0 else f"{job}-r{attempt}"


async def allocated_nodes(slurm: commands.SlurmCommands, env: Mapping[str, str]) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise SystemExit("aegis slurm coordinator: not inside a Slurm allocation")
    result = await slurm(commands.hostnames_argv(nodelist))
    if result.returncode != 0:
        raise SystemExit(f"scontrol show hostnames failed: {result.stderr.strip()}")
    return result.stdout.split()


_LOOPBACK = ("localhost", "::1", "")


def advertised(advertise: str, env: Mapping[str, str]) -> str:
    """How the agents on every node reach the batch host: ``advertise``, except that a
    loopback address (the default) reaches nobody on another node, so the batch host's node
    name stands for it (a node name is also a pod's address: it resolves on every node)."""
    if advertise not in _LOOPBACK and not advertise.startswith("127."):
        return advertise
    return env.get("SLURMD_NODENAME") or socket.gethostname()


async def budget_left(
    store: StatusStore, settings: CoordinatorSettings, attempt: int
) -> tuple[int, JobStatus | None]:
    """The fault budget this attempt starts with, and the last attempt's status, if any."""
    for earlier in range(attempt - 1, -1, -1):
        key = status_key(JobSpec(attempt_job(settings.job, earlier), settings.namespace, 1, 0))
        found = await store.get(key)
        if found is None:
            continue
        spec, status = status_json.from_dict(json.loads(found[0]))
        return max(spec.max_retry - status.recover_count, -1), status
    return settings.max_retry, None


def _authority(state_dir: Path) -> Authority:
    """The NATS keys, kept in the state directory: the JetStream store of a requeued attempt
    belongs to the same account, so the new server can read the previous attempts' status."""
    path = state_dir / "nats-authority.json"
    if path.exists():
        return Authority.load(path)
    authority = Authority()
    authority.save(path)
    return authority


async def run_coordinator(
    settings: CoordinatorSettings,
    env: Mapping[str, str] | None = None,
    slurm: commands.SlurmCommands | None = None,
) -> CoordinatorResult:
    env = dict(os.environ if env is None else env)
    if settings.partition is None and env.get("SLURM_JOB_PARTITION"):
        settings = dataclasses.replace(settings, partition=env["SLURM_JOB_PARTITION"])
    if not settings.holder_options:
        settings = dataclasses.replace(settings, holder_options=commands.holder_options(env))
    slurm = slurm or commands.SubprocessCommands()
    nodes = await allocated_nodes(slurm, env)
    if len(nodes) < settings.nodes:
        raise SystemExit(f"the allocation has {len(nodes)} nodes, the job needs {settings.nodes}")
    settings = dataclasses.replace(settings, advertise=advertised(settings.advertise, env))
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    attempt = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if settings.master is not None:
        return await _run_on_master(settings, nodes, attempt, slurm)
    authority = None if settings.nats_url else _authority(settings.state_dir)
    if authority is not None:
        (settings.state_dir / "nats").mkdir(exist_ok=True)
    master_settings = MasterSettings(
        grpc_host="0.0.0.0",
        job=JobSettings(
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            join_timeout_s=settings.join_timeout_s,
            # rank 0's node (a Slurm node owns its ports; the batch host is only where rank 0
            # starts)
            rendezvous=RendezvousRule(settings.advertise, port_base=TORCH_PORT),
        ),
    )
    async with run_master(
        master_settings,
        nats_url=settings.nats_url,
        authority=authority,
        server_host="0.0.0.0",  # on every address: the agents on the other nodes connect to it
        store_dir=settings.state_dir / "nats",
        advertise=settings.advertise,
    ) as master:
        return await _run_attempt(settings, master, nodes, attempt, slurm)


async def _run_attempt(
    settings: CoordinatorSettings,
    master: MasterService,
    nodes: list[str],
    attempt: int,
    slurm: commands.SlurmCommands,
) -> CoordinatorResult:
    budget, previous = await budget_left(master.store, settings, attempt)
    early = _already_over(settings, attempt, budget, previous)
    if early is not None:
        return early
    spec = JobSpec(attempt_job(settings.job, attempt), settings.namespace, settings.nodes, budget)
    log_dir = settings.state_dir / f"attempt-{attempt}"
    log_dir.mkdir(parents=True, exist_ok=True)
    platform = _platform(settings, nodes, log_dir, slurm)
    runner, token = await master.create_job(
        spec,
        nodes[: settings.nodes],
        platform,
        log_dir=log_dir,
        pod_ips=nodes[: settings.nodes],  # a pod's address is its node's name (resolved there)
    )
    platform.attach(
        runner.platform_event, namespace=spec.namespace, job=spec.job, pods=runner.pod_nodes(),
        master=f"{settings.advertise}:{master.grpc_port}", token=token,
    )  # fmt: skip
    # aegis ctl --log-dir <state>/attempt-N (a drain also drains the node in Slurm)
    control_file = await job_files.serve_control(runner, platform, log_dir)
    loop = asyncio.get_running_loop()
    lost = asyncio.Event()

    def on_term() -> None:
        # Slurm is taking the allocation away (requeue, preemption, scancel): stop the steps
        # and leave the status as it is in the store, so a requeued attempt resumes from it.
        log.warning("SIGTERM: the allocation is going away; the job's status stays in the store")
        lost.set()
        runner.close()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        await platform.launch_all()
        await runner.wait_done()
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        await platform.stop_all()
        if control_file is not None:
            control_file.unlink(missing_ok=True)
    if settings.status_file is not None and not lost.is_set():
        job_files.write_status_file(settings.status_file, spec, runner.status)
    placements = [(str(p), n) for p, n in platform.placements]
    return CoordinatorResult(spec, runner.status, placements, list(platform.drained))


async def _run_on_master(
    settings: CoordinatorSettings, nodes: list[str], attempt: int, slurm: commands.SlurmCommands
) -> CoordinatorResult:
    """The job on an existing master: submit it, serve this allocation, wait for its end."""
    assert settings.master is not None and settings.nats_url is not None
    creds = Authority.load(settings.auth_file).master_creds() if settings.auth_file else None
    bus = await NatsBus.connect(settings.nats_url, creds, name=f"slurm-{settings.job}")
    try:
        store = await KvStore.open(bus, STATUS_BUCKET)
        budget, previous = await budget_left(store, settings, attempt)
        early = _already_over(settings, attempt, budget, previous)
        if early is not None:
            return early
        if previous is not None:  # the lost allocation's attempt: the master still leads it
            await _supersede(bus, store, creds, settings, attempt)
        spec = JobSpec(attempt_job(settings.job, attempt), settings.namespace, settings.nodes,
                       budget)  # fmt: skip
        log_dir = settings.state_dir / f"attempt-{attempt}"
        log_dir.mkdir(parents=True, exist_ok=True)
        platform = _platform(settings, nodes, log_dir, slurm)
        placed = nodes[: settings.nodes]
        try:
            served = await ServedJob.submit(bus, store, spec, placed, platform, pod_ips=placed)
        except StoreConflictError:
            raise SystemExit(
                f"aegis slurm: job {spec.job} is already in the master's store (namespace "
                f"{spec.namespace}); submit it under another --job"
            ) from None
        platform.attach(
            served.server.sink, namespace=spec.namespace, job=spec.job,
            pods=dict(zip(pod_names(spec), placed, strict=True)), master=settings.master,
            token=served.token,
        )  # fmt: skip
        lost = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, _on_lost, lost)
        try:
            await platform.launch_all()
            status = await served.wait(lost)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            await platform.stop_all()
        if settings.status_file is not None and not lost.is_set():
            job_files.write_status_file(settings.status_file, spec, status)
        placements = [(str(p), n) for p, n in platform.placements]
        return CoordinatorResult(spec, status, placements, list(platform.drained))
    finally:
        await bus.close()


async def _supersede(
    bus: NatsBus,
    store: KvStore,
    creds: UserCreds | None,
    settings: CoordinatorSettings,
    attempt: int,
) -> None:
    """Stop the last earlier attempt, which the running master still leads (its allocation
    is gone, nobody serves it; this attempt has taken its budget over). A failure is logged:
    the new attempt runs anyway."""
    prefix = creds.inbox_prefix if creds is not None else "_INBOX"
    for earlier in range(attempt - 1, -1, -1):
        name = attempt_job(settings.job, earlier)
        if await store.get(status_key(JobSpec(name, settings.namespace, 1, 0))) is None:
            continue
        reason = f"requeued: attempt {attempt} ({attempt_job(settings.job, attempt)}) took over"

        def build(inbox: str, name: str = name, reason: str = reason) -> control.ControlRequest:
            return control.ControlRequest("stop", inbox, settings.namespace, job=name,
                                          reason=reason)  # fmt: skip

        try:
            reply = await control.request(bus, build, inbox_prefix=prefix, timeout_s=10.0)
            log.warning("earlier attempt %s: %s", name, reply.message)
        except (TimeoutError, OSError) as exc:
            log.error("could not stop %s on the master: %r", name, exc)
        return


def _on_lost(lost: asyncio.Event) -> None:
    log.warning("SIGTERM: the allocation is going away; the job's status stays in the store")
    lost.set()


def _already_over(
    settings: CoordinatorSettings, attempt: int, budget: int, previous: JobStatus | None
) -> CoordinatorResult | None:
    """A requeued attempt of a job that ended (or spent its budget) runs nothing."""
    if previous is not None:
        log.warning(
            "requeued (attempt %d): %d of %d faults left", attempt, budget, settings.max_retry
        )
    if previous is not None and (previous.phase in (Phase.SUCCEED, Phase.FAILED) or budget < 0):
        job = attempt_job(settings.job, attempt)
        spec = JobSpec(job, settings.namespace, settings.nodes, max(budget, 0))
        return CoordinatorResult(spec, previous, [], [])
    return None


def _platform(
    settings: CoordinatorSettings, nodes: list[str], log_dir: Path, slurm: commands.SlurmCommands
) -> SlurmPlatform:
    ranked, spares = nodes[: settings.nodes], nodes[settings.nodes :]
    return SlurmPlatform(
        pod_settings(
            SlurmSettings, settings, ranked, spares, log_dir,
            partition=settings.partition, holder_options=settings.holder_options,
        ),
        slurm,
    )  # fmt: skip
