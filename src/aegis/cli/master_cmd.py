"""``aegis master``: one master replica (leader election among replicas on the NATS KV)."""

from __future__ import annotations

import asyncio
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
from aegis.master import metrics
from aegis.master.job_runner import JobSettings
from aegis.master.lease import LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings


def register(app: typer.Typer) -> None:
    app.command("master")(master)


def master(
    nats: Annotated[str, typer.Option(help="The NATS server (or cluster) URL.")],
    auth_file: Annotated[
        Path | None,
        typer.Option(help="The operator/account keys shared by all replicas (0600)."),
    ] = None,
    grpc_port: Annotated[int, typer.Option(min=0, max=65535, help="Credentials server.")] = 0,
    grpc_host: Annotated[str, typer.Option(help="Address the credentials server binds.")] = (
        "127.0.0.1"
    ),
    replica_id: Annotated[str | None, typer.Option(help="Default: host:pid.")] = None,
    lease_s: Annotated[float, typer.Option(min=0.5, help="Leader lease.")] = 2.0,
    heartbeat_timeout_s: Annotated[float, typer.Option(min=0.5)] = 5.0,
    log_dir: Annotated[Path | None, typer.Option(help="Where events.jsonl goes.")] = None,
    replicas: Annotated[int, typer.Option(min=1, help="JetStream replicas of the buckets.")] = 1,
    metrics_port: Annotated[
        int, typer.Option(min=0, max=65535, help="Serve Prometheus /metrics (0: off).")
    ] = 0,
) -> None:
    """Run a master replica: standby until it holds the lease, then leader of every job."""
    if auth_file is not None and not auth_file.is_file():
        raise typer.BadParameter(f"no such file: {auth_file}", param_hint="--auth-file")
    authority = Authority.load(auth_file) if auth_file else None
    settings = ReplicaSettings(
        replica_id=replica_id or f"{socket.gethostname()}:{os.getpid()}",
        lease=LeaseSettings(lease_s=lease_s, replicas=replicas),
        job=JobSettings(
            heartbeat_timeout_s=heartbeat_timeout_s,
            chaos_exit_after_persist=os.environ.get("AEGIS_CHAOS_EXIT_AFTER_PERSIST", ""),
            chaos_marker=log_dir / ".chaos-done" if log_dir else None,
        ),
        log_dir=log_dir,
        grpc_host=grpc_host,
        grpc_port=grpc_port,
    )
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s {settings.replica_id} %(levelname)s %(name)s: %(message)s",
    )
    lifecycle.die_with_parent(signal.SIGTERM)
    replica = Replica(authority, nats, settings)
    if metrics_port:
        replica.metrics = metrics.MasterMetrics()
        replica.metrics.serve(metrics_port)
    asyncio.run(_serve(replica))


async def _serve(replica: Replica) -> None:
    task = asyncio.create_task(replica.run(), name="replica")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        return
