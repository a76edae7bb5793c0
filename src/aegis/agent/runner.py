"""``aegis agent`` on its own node: tini's duties plus the supervisor, until the command ends.

PID-1 checklist (tini ``src/tini.c``): become a child subreaper when not PID 1; forward every
signal but SIGTERM, SIGCHLD, the faults and job control (``pid1.FORWARDED_SIGNALS``: SIGINT,
SIGHUP, SIGUSR1, SIGALRM, SIGPWR, ..., the same under a master) to the command's group; SIGTERM
starts the agent's own stop (SIGTERM to the group, grace period, then SIGKILL); reap every
zombie; exit with the command's status.
With ``--master`` the agent first checks that the master answers; when it does not, it says so in
one line and runs the command independently (seed ``RunIndependent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from aegis.adapters import lifecycle
from aegis.agent import group, link_settings, linked, pid1, ports, reaper, supervisor
from aegis.checks import config as checks_config

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class MasterAddress:
    """Where the agent finds its master and who it is there (not the master's own settings,
    ``master.service.MasterSettings``)."""

    host: str
    port: int
    job: str | None = None
    pod: str | None = None
    token_file: str | None = None
    connect_timeout_s: float = 10.0
    namespace: str = "default"
    node: str = ""
    heartbeat_s: float = 1.0
    health_s: float = 30.0  # between looks at the node's GPUs (0: none; agent.health)
    tls_ca: Path | None = None  # TLS to the master and NATS, trusting this CA only
    rejoin: bool = False  # a pod placed again in a running job: never run independently

    def missing_flags(self) -> str:
        """The flags a linked agent needs and this address lacks: ``--pod and --token-file``."""
        given = (("--job", self.job), ("--pod", self.pod), ("--token-file", self.token_file))
        missing = [flag for flag, value in given if not value]
        return " and ".join(missing) if len(missing) < 3 else "--job, --pod and --token-file"


@dataclasses.dataclass(frozen=True, slots=True)
class AgentSettings:
    supervisor: supervisor.SupervisorSettings
    master: MasterAddress | None = None


async def master_answers(master: MasterAddress) -> bool:
    """Whether a TCP connection to the master opens within the connect timeout."""
    try:
        async with asyncio.timeout(master.connect_timeout_s):
            _, writer = await asyncio.open_connection(master.host, master.port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def run(settings: AgentSettings, argv: Sequence[str], parent: int | None = None) -> int:
    """Supervise ``argv`` until it ends; return the exit status to leave with (``parent``: the
    run that started this agent, ``LinkSettings.parent``)."""
    if settings.master is not None:
        master = settings.master
        if master.job and master.pod and master.token_file:
            try:
                link_settings = _link_settings(master, parent)
            except ValueError as exc:  # a misconfigured job: say so, do not run half-configured
                print(f"aegis agent: error: {exc}", file=sys.stderr, flush=True)
                return 2
            code = await linked.run_linked(settings.supervisor, link_settings, argv)
            if code is not None:
                return code
        else:
            print(
                f"aegis agent: warning: master {master.host}:{master.port} given without "
                f"{master.missing_flags()}; running the command independently, "
                "without fault tolerance",
                file=sys.stderr,
                flush=True,
            )
    reaper.become_subreaper()
    async with (
        reaper.Reaper() as the_reaper,
        supervisor.Supervisor(argv, settings.supervisor, the_reaper, ports.LoggingReports()) as sup,
    ):
        stopping: list[asyncio.Task[ports.ExitReport | None]] = []

        def on_sigterm() -> None:
            if not stopping:
                log.info("SIGTERM: stopping the command")
                stopping.append(asyncio.create_task(sup.stop(), name="agent-stop"))

        with pid1.signals(sup.send_signal, on_sigterm):
            await sup.start()
            report = await sup.wait()
            for task in stopping:
                await task
            await group.terminate_descendants(settings.supervisor.grace_s)
    return report.exit_status


def _link_settings(master: MasterAddress, parent: int | None) -> link_settings.LinkSettings:
    assert master.job and master.pod and master.token_file
    return link_settings.LinkSettings(
        grpc_target=f"{master.host}:{master.port}",
        namespace=master.namespace,
        job=master.job,
        pod=master.pod,
        token=Path(master.token_file).read_text().strip(),
        node=master.node,
        heartbeat_s=master.heartbeat_s,
        health_s=master.health_s,
        connect_timeout_s=master.connect_timeout_s,
        tls_ca=master.tls_ca,
        rejoin=master.rejoin,
        inject=link_settings.inject_from_env(),
        checks=checks_config.from_env(os.environ),
        ckpt_dir=Path(os.environ["AEGIS_CKPT_DIR"]) if os.environ.get("AEGIS_CKPT_DIR") else None,
        parent=parent,
    )


def main(settings: AgentSettings, argv: Sequence[str]) -> int:
    parent = lifecycle.die_with_parent(signal.SIGTERM)  # under a local platform: stop with it
    return asyncio.run(run(settings, argv, parent))
