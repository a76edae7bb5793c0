"""``aegis master``: one master replica (leader election among replicas on the NATS KV).

``--kubernetes``: jobs come from AegisJob resources and their status goes back to them
(``platforms.kubernetes.master_side``), next to the replica and only while it leads; so do
the PyTorchJobs and JobSets whose pods the admission webhook wraps, their status going into the
annotation ``aegis.dev/status`` (``platforms.kubernetes.wrapped_source``).

Authentication is not optional: without ``--auth-file`` (the keys ``aegis auth init`` writes) the
master refuses to start, before connecting, unless told ``--insecure`` (a NATS server without
auth, on a trusted network). ``--tls-dir DIR`` (``tls.crt``, ``tls.key``, ``ca.crt``: a
Kubernetes TLS Secret) makes the credentials server speak TLS only and the NATS connection trust
``ca.crt`` only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Annotated

import typer

from aegis.adapters import lifecycle
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.tls import TlsConfigError, TlsDir
from aegis.cli import options, paths
from aegis.core import retention
from aegis.core.rendezvous import TORCH_PORT, RendezvousRule
from aegis.master import chaos, metrics
from aegis.master.drained_nodes import BUCKET as DRAINED_BUCKET
from aegis.master.drained_nodes import DrainedNodes
from aegis.master.job_runner import JobSettings
from aegis.master.lease import LeaseSettings
from aegis.master.pace import PaceSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET


def register(app: typer.Typer) -> None:
    app.command("master")(master)


# The options of ``aegis master``, one alias each, so the command's function stays short.
Nats = Annotated[
    str,
    typer.Option(
        help="The NATS server URL (a cluster: every server, comma-separated).",
        callback=options.nats_url,
    ),
]
AuthFile = Annotated[
    Path | None,
    typer.Option(
        help="The operator/account keys shared by all replicas (0600; `aegis auth init`)."
    ),
]
Insecure = Annotated[
    bool,
    typer.Option(
        help="Run without --auth-file: NATS without authentication (a trusted network only)."
    ),
]
TlsDirOption = Annotated[
    Path | None,
    typer.Option(
        help="tls.crt and tls.key: the credentials server speaks TLS only; ca.crt (if "
        "there): the CA the NATS server's certificate must be signed by."
    ),
]
GrpcPort = Annotated[int, typer.Option(min=0, max=65535, help="Credentials server.")]
GrpcHost = Annotated[str, typer.Option(help="Address the credentials server binds.")]
ReplicaId = Annotated[str | None, typer.Option(help="Default: host:pid.")]
LeaseS = Annotated[
    float | None,
    typer.Option(min=0.5, help="Leader lease (default: 2 s; 12 s with --replicas above 1)."),
]
LogDir = Annotated[
    Path | None, typer.Option(help="Where events.jsonl goes.", callback=paths.made_dir)
]
Replicas = Annotated[int, typer.Option(min=1, help="JetStream replicas of the buckets.")]
MetricsHost = Annotated[
    str, typer.Option(help="Address /metrics binds (0.0.0.0 in a pod, to be scraped).")
]
Kubernetes = Annotated[
    bool,
    typer.Option(
        help="Learn jobs from AegisJobs, and from the PyTorchJobs/JobSets whose pods the "
        "admission webhook wraps; write their status back."
    ),
]
RendezvousPortBase = Annotated[
    int,
    typer.Option(
        min=0,
        max=63535,
        help="Rounds meet on rank 0's pod, port BASE + 2*(round % 1000) of the range each "
        "pod's host owns (0: a port free on this host, only when every pod shares it).",
    ),
]
RendezvousHost = Annotated[
    str | None,
    typer.Option(
        help="Where rounds meet while rank 0's pod address is unknown ({job} and "
        "{namespace} filled in). Default: rank 0's headless service with --kubernetes, "
        "else 127.0.0.1.",
    ),
]
K8sNamespace = Annotated[
    list[str] | None,
    typer.Option(help="With --kubernetes: watch these namespaces (default: all)."),
]
KeepEnded = Annotated[
    float,
    typer.Option(
        min=0,
        help="How long an ended job's record stays in the store (for `aegis status "
        "--nats`) before the leader removes it (0: kept forever; default a week).",
    ),
]
CordonDrained = Annotated[
    bool,
    typer.Option(
        help="With --kubernetes: cordon a node `aegis ctl drain` drains "
        "(needs the right to patch nodes)."
    ),
]


def master(  # noqa: PLR0913 (a typer command: one parameter per option)
    nats: Nats,
    auth_file: AuthFile = None,
    insecure: Insecure = False,
    tls_dir: TlsDirOption = None,
    grpc_port: GrpcPort = 0,
    grpc_host: GrpcHost = "127.0.0.1",
    replica_id: ReplicaId = None,
    lease_s: LeaseS = None,
    heartbeat_timeout_s: options.HeartbeatTimeout = 5.0,
    join_timeout_s: options.JoinTimeout = 600.0,
    pace_window_s: options.PaceWindow = options.WINDOW_DEFAULT,
    pace_drop: options.PaceDrop = options.DROP_DEFAULT,
    log_dir: LogDir = None,
    replicas: Replicas = 1,
    metrics_port: options.MetricsPort = 0,
    metrics_host: MetricsHost = "127.0.0.1",
    kubernetes: Kubernetes = False,
    rendezvous_port_base: RendezvousPortBase = TORCH_PORT,
    rendezvous_host: RendezvousHost = None,
    k8s_namespace: K8sNamespace = None,
    keep_ended_s: KeepEnded = retention.KEEP_ENDED_S,
    cordon_drained: CordonDrained = False,
) -> None:
    """Run a master replica: standby until it holds the lease, then leader of every job."""
    if cordon_drained and not kubernetes:
        raise typer.BadParameter("needs --kubernetes", param_hint="--cordon-drained")
    authority = _authority(auth_file, insecure)
    tls = _tls(tls_dir)
    job = JobSettings(
        heartbeat_timeout_s=heartbeat_timeout_s, join_timeout_s=join_timeout_s,
        pace=PaceSettings(pace_window_s, pace_drop),
        rendezvous=_rendezvous_rule(kubernetes, rendezvous_host, rendezvous_port_base),
    )  # fmt: skip
    settings = ReplicaSettings(
        replica_id=replica_id or f"{socket.gethostname()}:{os.getpid()}",
        lease=LeaseSettings.for_replicas(replicas, lease_s), job=job, log_dir=log_dir,
        grpc_host=grpc_host, grpc_port=grpc_port, tls_dir=tls, keep_ended_s=keep_ended_s,
    )  # fmt: skip
    replica = _replica(authority, nats, settings, metrics_port, metrics_host)
    side = _kubernetes_side(tuple(k8s_namespace or ()), cordon_drained) if kubernetes else None
    asyncio.run(_serve(replica, side))


def _replica(
    authority: Authority | None,
    nats: str,
    settings: ReplicaSettings,
    metrics_port: int,
    metrics_host: str,
) -> Replica:
    """The replica, logging to stderr, ending with its parent, serving /metrics if asked."""
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s {settings.replica_id} %(levelname)s %(name)s: %(message)s",
    )
    lifecycle.die_with_parent(signal.SIGTERM)
    replica = Replica(authority, nats, settings, chaos.from_env(os.environ, settings.log_dir))
    if metrics_port:
        replica.metrics = metrics.MasterMetrics()
        options.serve_metrics(replica.metrics, metrics_port, metrics_host)
    return replica


def _kubernetes_side(namespaces: tuple[str, ...], cordon: bool) -> object:
    """``--kubernetes``'s settings; exit 2 (one line) without the kubernetes client."""
    try:
        from aegis.platforms.kubernetes import master_side
    except ImportError as exc:
        print(f"aegis: error: --kubernetes needs the kubernetes client ({exc})",
              file=sys.stderr)  # fmt: skip
        raise typer.Exit(2) from exc
    return master_side.KubernetesSettings(namespaces=namespaces, cordon=cordon)


def _authority(auth_file: Path | None, insecure: bool) -> Authority | None:
    """The keys of ``--auth-file``; None only with ``--insecure``; exit 2 (one line) when
    neither or both are given."""
    if auth_file is None and not insecure:
        print(
            "aegis: error: aegis master needs --auth-file FILE (the keys `aegis auth init` "
            "writes), or --insecure to run NATS without authentication",
            file=sys.stderr,
        )
        raise typer.Exit(2)
    if auth_file is None:
        return None
    if insecure:
        raise typer.BadParameter("not with --auth-file", param_hint="--insecure")
    try:
        return Authority.load(auth_file)
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise typer.BadParameter(
            f"cannot read {auth_file}: {exc}", param_hint="--auth-file"
        ) from None


def _tls(tls_dir: Path | None) -> TlsDir | None:
    if tls_dir is None:
        return None
    try:
        return TlsDir(tls_dir).check()
    except TlsConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tls-dir") from None


def _rendezvous_rule(kubernetes: bool, host: str | None, port_base: int) -> RendezvousRule:
    """The master shares no host with its pods: each round on a port of the range rank 0's
    pod owns; the host where no pod address is known yet (a pod's ACK says it)."""
    if kubernetes:
        from aegis.platforms.kubernetes.manifests import RENDEZVOUS_RULE as default
    else:
        default = RendezvousRule()
    try:
        return RendezvousRule(
            fallback_host=default.fallback_host if host is None else host, port_base=port_base
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rendezvous-port-base") from None


LEAVE_S = 5.0  # after a stop, what the replica left running gets this long to end


async def _serve(replica: Replica, kubernetes: object | None = None) -> None:
    task = asyncio.create_task(_run(replica, kubernetes), name="replica")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        left = await leave_within(LEAVE_S)
        if left:  # a master told to stop must stop
            logging.getLogger(__name__).warning(
                "%s did not end within %g s of the stop: exiting anyway", ", ".join(left), LEAVE_S
            )
            logging.shutdown()
            failed = task.done() and not task.cancelled() and task.exception() is not None
            os._exit(1 if failed else 0)


async def leave_within(seconds: float) -> list[str]:
    """Cancel every other task of the loop and give them ``seconds`` to end; the names of those
    that did not (a NATS client still reconnecting to a server that is gone was one)."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for other in others:
        other.cancel()
    if not others:
        return []
    _, pending = await asyncio.wait(others, timeout=seconds)
    return sorted(t.get_name() for t in pending)


async def _run(replica: Replica, kubernetes: object | None) -> None:
    if kubernetes is None:
        await replica.run()
        return
    from aegis.platforms.kubernetes import cluster, master_side, wrapped_source

    assert isinstance(kubernetes, master_side.KubernetesSettings)
    api = cluster.KubernetesCluster(cluster.load_config())  # without credentials: before NATS
    creds = replica.authority.master_creds() if replica.authority else None
    bus = await NatsBus.connect(replica.nats_url, creds, name=f"{replica.settings.replica_id}-k8s",
                                tls_ca=replica.settings.nats_ca)  # fmt: skip
    try:
        replicas = replica.settings.lease.replicas
        store = await KvStore.open(bus, STATUS_BUCKET, replicas=replicas)
        record = DrainedNodes(await KvStore.open(bus, DRAINED_BUCKET, replicas=replicas))
        side = master_side.KubernetesSide(api, bus, store, kubernetes, drained=record,
                                          leading=replica.leading.is_set)  # fmt: skip
        # The PyTorchJobs/JobSets whose pods the webhook wraps (none where not installed).
        wrapped = wrapped_source.WrappedSide(wrapped_source.WrappedJobs(api), bus, store,
                                             kubernetes, drained=record,
                                             leading=replica.leading.is_set)  # fmt: skip
        async with asyncio.TaskGroup() as group:
            group.create_task(replica.run(), name="replica")
            group.create_task(side.run(), name="kubernetes")
            group.create_task(wrapped.run(), name="kubernetes-wrapped")
    finally:
        await bus.close()
