"""``SlurmPlatform``: the Platform port inside one Slurm allocation.

Each pod is an ``srun`` step pinned to one allocated node, running ``aegis agent``. A pod that
must move (level 3, slow eviction) gets a new step on a healthy spare node of the allocation, or,
with none left, on a newly requested node: a one-node Slurm job that holds it (excluding every
node this job has or has given up) gets the step (``srun --jobid``), and is cancelled with the job;
a container restart (level 2) and a lost pod get a new step on the same node. A blacklisted node
is drained in Slurm (``scontrol update ... state=drain reason="aegis: <reason>"``), so neither
this job nor any other (nor this job after a requeue) is placed on it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from aegis.core.model import PodName
from aegis.platforms.process_pods import Pod, PodSettings, ProcessPods
from aegis.platforms.slurm import commands

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SlurmSettings(PodSettings):
    """``nodes``: the pods' nodes, in rank order; ``spares``: the rest of the allocation."""

    request_nodes: bool = True  # no healthy spare left: ask Slurm for one more node
    node_request_s: float = 300.0  # how long to wait for it before giving up on the job
    node_poll_s: float = 0.5
    partition: str | None = None  # the requested node's partition (default: Slurm's)
    holder_options: tuple[str, ...] = ()  # the allocation's resources, for a requested node


class SlurmPlatform(ProcessPods):
    task_name = "slurm-platform"

    def __init__(
        self,
        settings: SlurmSettings,
        slurm: commands.SlurmCommands | None = None,
    ) -> None:
        super().__init__(settings)
        self.settings: SlurmSettings = settings
        self.slurm: commands.SlurmCommands = slurm or commands.SubprocessCommands()
        self.drained: list[tuple[str, str]] = []
        self.requested: dict[str, str] = {}  # a requested node -> the Slurm job holding it

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        log.warning("node %s blacklisted: %s; draining it in Slurm", node, reason)
        self.blacklist[node] = reason
        await self.drain_node(node, reason)

    # -- aegis ctl drain / undrain (node_drains.NodeDrainer, control.KnownNodes) -------------

    def node_pool(self) -> tuple[str, ...]:
        return (*self.settings.nodes, *self.settings.spares, *self.requested)

    async def drain_node(self, node: str, reason: str) -> None:
        result = await self.slurm(commands.drain_argv(node, reason))
        if result.returncode != 0:
            log.error("draining %s failed (%d): %s", node, result.returncode, result.stderr)
            return
        self.drained.append((node, reason))

    async def undrain_node(self, node: str) -> None:
        result = await self.slurm(commands.resume_argv(node))
        if result.returncode != 0:
            log.error("resuming %s failed (%d): %s", node, result.returncode, result.stderr)
            return
        log.warning("node %s resumed in Slurm (aegis ctl undrain)", node)

    # -- placement -----------------------------------------------------------------------------

    async def _more_node(self, pod: PodName) -> str | None:
        return await self._request_node(pod) if self.settings.request_nodes else None

    async def _left_node(self, node: str, now_on: str | None) -> None:
        if node in self.requested and node in self.blacklist and now_on != node:
            await self._release(node)

    async def _request_node(self, pod: PodName) -> str | None:
        """A new node from Slurm for ``pod``, or None when it was refused, not granted in
        ``node_request_s``, or the job is stopping (the request is cancelled then, also when
        this task is)."""
        s = self.settings
        exclude = self.known_nodes() | set(self.blacklist)
        output = s.log_dir / "requested-node-%j.out"
        argv = commands.request_node_argv(
            f"{self.job}-node", exclude, output, s.partition, s.holder_options
        )
        result = await self.slurm(argv)
        if result.returncode != 0:
            log.error("requesting a node for %s failed: %s", pod, result.stderr.strip())
            return None
        job_id = result.stdout.strip().split(";")[0]
        log.warning("no healthy spare for %s: requested a node (Slurm job %s)", pod, job_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.node_request_s
        granted = None
        try:
            while loop.time() < deadline and not self.stopping:
                words = (await self.slurm(commands.job_state_argv(job_id))).stdout.split()
                state, node = [*words, "", ""][:2]
                if state == "RUNNING" and node:
                    granted = node
                    self.requested[node] = job_id
                    return node
                if state not in ("PENDING", "CONFIGURING", "RUNNING"):
                    break  # refused, cancelled or failed
                await asyncio.sleep(s.node_poll_s)
            log.error("Slurm job %s did not give %s a node in time", job_id, pod)
            return None
        finally:
            if granted is None:
                await self.slurm(commands.cancel_argv(job_id))

    async def _release(self, node: str) -> None:
        job_id = self.requested.pop(node)
        result = await self.slurm(commands.cancel_argv(job_id))
        if result.returncode != 0:
            log.error("cancelling Slurm job %s (node %s) failed: %s", job_id, node, result.stderr)

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        await _stop_step(proc, self.settings.grace_s)

    async def _start(self, state: Pod, token_file: Path) -> bool:
        s = self.settings
        inject = s.inject.get(state.node, frozenset())
        step = commands.AgentStep(
            job=self.job, namespace=self.namespace, pod=state.name,
            node=state.node, master=self.master, token_file=token_file, command=s.command,
            grace_s=s.grace_s, hang_timeout_s=s.hang_timeout_s, heartbeat_s=s.heartbeat_s,
            health_s=s.health_s,
            job_id=self.requested.get(state.node), rejoin=state.incarnation > 1,
        )  # fmt: skip
        with self.pod_log(state, "step").open("ab") as out:
            state.process = await asyncio.create_subprocess_exec(
                *commands.srun_argv(step), stdout=out, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, env=commands.step_env(os.environ, inject),
                start_new_session=True,
            )  # fmt: skip
        return True

    async def stop_all(self) -> None:
        """Wait (bounded) for the steps to end with their agents, then stop what is left; a
        node request in flight is given up (and cancelled in Slurm)."""
        await super().stop_all()
        for node in list(self.requested):  # the requested nodes go back with the job
            await self._release(node)


async def _stop_step(proc: asyncio.subprocess.Process, grace_s: float) -> None:
    """srun forwards SIGTERM to the agent (which stops its training group); SIGKILL of srun
    after the grace period makes Slurm kill what is left of the step."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace_s + 2.0)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
