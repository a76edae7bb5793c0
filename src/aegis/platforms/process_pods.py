"""What the platforms that run each pod as a process share: the local one (``local.py``) and
Slurm's (``slurm/platform.py``).

``ProcessPods`` holds the pods, their placements and the blacklist, and implements the
Platform port's moves: a pod is retired (its process stopped, after it had ``exit_wait_s`` to
exit on its own when the master evicted it), placed on its node again (a restart in place) or
on a healthy spare, and started; no node left, or a node that cannot take it, ends the job with
a ``QuitRequested``. A platform says how a pod's process starts (``_start``) and stops
(``_stop``), where a pod can be reached (``_address``), whether a node is down (``_down``: a pod
lost there goes to a spare), and may find a node beyond its spares (``_more_node``) or give one
back (``_left_node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from aegis.adapters import nats_auth
from aegis.core import events as ev
from aegis.core.model import NodeName, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodSettings:
    """What the pods of every process platform are: where they may go, what they run, and how
    their agents are started and stopped."""

    nodes: tuple[str, ...]  # the pods' nodes, in rank order
    spares: tuple[str, ...]  # where pods moved off a node go, in order
    command: tuple[str, ...]
    log_dir: Path
    inject: Mapping[str, frozenset[str]] = field(default_factory=dict)  # node -> checks
    grace_s: float = 5.0
    hang_timeout_s: float | None = None  # None: each agent calibrates; 0: off
    heartbeat_s: float = 1.0
    health_s: float = 30.0  # between the agents' looks at their GPUs (0: none)
    exit_wait_s: float = 30.0


class PodSource(Protocol):
    """What a run's settings say of its pods, whichever process platform runs them."""

    @property
    def command(self) -> tuple[str, ...]: ...
    @property
    def inject(self) -> Mapping[str, frozenset[str]]: ...
    @property
    def grace_s(self) -> float: ...
    @property
    def hang_timeout_s(self) -> float | None: ...
    @property
    def health_s(self) -> float: ...


S = TypeVar("S", bound=PodSettings)


def pod_settings(
    kind: type[S],
    source: PodSource,
    nodes: Sequence[str],
    spares: Sequence[str],
    log_dir: Path,
    **more: Any,
) -> S:
    """A process platform's settings (``kind``) for a run's pods on ``nodes`` (in rank order)
    with ``spares``, logging under ``log_dir``; ``more``: the platform's own fields."""
    return kind(
        nodes=tuple(nodes), spares=tuple(spares), command=source.command, log_dir=log_dir,
        inject=source.inject, grace_s=source.grace_s, hang_timeout_s=source.hang_timeout_s,
        health_s=source.health_s, **more,
    )  # fmt: skip


@dataclass(slots=True)
class Pod:
    name: PodName
    node: str
    process: asyncio.subprocess.Process | None = None
    incarnation: int = 0
    containers_on_node: int = 0  # this pod's containers (agents) started on ``node`` so far


class ProcessPods:
    """The Platform port for pods that are processes this one starts (see the module)."""

    task_name = "platform"

    def __init__(self, settings: PodSettings) -> None:
        self.settings = settings
        self.exit_wait_s, self.log_dir = settings.exit_wait_s, settings.log_dir
        self.pods: dict[PodName, Pod] = {}
        self.blacklist: dict[str, str] = {}
        self.used_nodes: set[str] = set()
        self.placements: list[tuple[PodName, str]] = []  # every (pod, node) ever used
        self.sink: Callable[[ev.Event], None] | None = None
        self.namespace, self.job = "default", ""
        self.initial: dict[PodName, str] = {}
        self.job_token: str | None = None
        self.master = ""  # the credentials server, as the agents reach it
        self.stopping = False
        self.killed = False  # the run killed its pods: none starts any more
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what a platform says --------------------------------------------------------------------

    def node_pool(self) -> tuple[str, ...]:
        """Every node a pod may be placed on, in the order spares are taken."""
        return (*self.settings.nodes, *self.settings.spares)

    async def _start(self, state: Pod, token_file: Path) -> bool:
        """Start ``state``'s agent on ``state.node`` (sets ``state.process``); False when the
        run killed its pods meanwhile (``killed``)."""
        raise NotImplementedError

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """Stop an agent and what it started."""
        raise NotImplementedError

    def _address(self, node: str) -> str:
        """The pod IP of a pod placed on ``node``."""
        return node

    def _down(self, node: str) -> str | None:
        """Why ``node`` cannot take a pod now, as the platform sees it (None: as far as it
        knows, it can): a pod lost there goes to a spare instead of coming back."""
        return None

    async def _more_node(self, pod: PodName) -> str | None:
        """A node beyond the pool for ``pod`` when no spare is left (None: there is none)."""
        return None

    async def _left_node(self, node: str, now_on: str | None) -> None:
        """A pod left ``node`` for ``now_on`` (None: for nowhere)."""
        return None

    # -- set-up ----------------------------------------------------------------------------------

    def attach(
        self,
        sink: Callable[[ev.Event], None],
        *,
        namespace: str,
        job: str,
        pods: Mapping[PodName, str],
        master: str,
        token: str,
    ) -> None:
        """``sink`` receives the platform's events (a runner's ``platform_event``, or a
        publisher to the master's replicas); ``pods`` is the initial placement; ``master``:
        HOST:PORT[,HOST:PORT] of the credentials server as the agents reach it."""
        self.sink, self.namespace, self.job, self.initial = sink, namespace, job, dict(pods)
        self.master = master
        self.job_token = token  # each pod gets only its own secret, derived from it

    async def launch_all(self) -> None:
        for pod, node in sorted(self.initial.items()):
            self.pods[pod] = Pod(pod, node)
            await self._spawn(self.pods[pod])

    # -- the Platform port -----------------------------------------------------------------------

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        self._background(self._replace(PodName(pod), same_node=True, reason=reason))

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        same = level is RecoveryLevel.CONTAINER
        self._background(self._replace(PodName(pod), same_node=same, reason=reason, wait=True))

    def known_nodes(self) -> frozenset[str]:
        return frozenset(self.node_pool())

    async def end_job(self, job: str, phase: Phase) -> None:
        log.info("job %s %s: its pods end with their agents", job, phase)

    # -- placement -------------------------------------------------------------------------------

    async def _replace(
        self, pod: PodName, *, same_node: bool, reason: str, wait: bool = False
    ) -> None:
        state = self.pods[pod]
        await self._retire(state, wait_for_exit=wait)
        left = state.node
        down = self._down(left)
        assert self.sink is not None
        if down is not None and left not in self.blacklist:
            log.warning("node %s is down (%s): %s goes elsewhere", left, down, pod)
            self.blacklist[left] = f"down: {down}"
            self.sink(ev.NodeDown(NodeName(left), f"down: {down}"))
        node = left if same_node and left not in self.blacklist else self._spare()
        if node is None and not self.stopping:
            node = await self._more_node(pod)
        if node is not None:
            self.used_nodes.add(node)  # taken now: a concurrent move must not pick it too
        await self._left_node(left, node)
        if node is None:
            log.error("no healthy node left for %s", pod)
            self.sink(ev.QuitRequested(f"no healthy node left for {pod}"))
            return
        if node != left:
            self.used_nodes.discard(left)
            state.containers_on_node = 0
        state.node = node
        try:
            started = await self._spawn(state)
        except (OSError, RuntimeError) as exc:  # the node could not be made, the agent started
            log.error("%s could not be placed on %s: %s", pod, node, exc)
            self.sink(ev.QuitRequested(f"{pod} could not be placed on {node}: {exc}"))
            return
        if not started:
            log.info("%s not placed on %s: the run killed its pods", pod, node)
            return
        self.sink(ev.PodRestarted(pod, NodeName(node), self._address(node)))
        log.info("%s placed on %s (%s)", pod, node, reason)

    def _spare(self) -> str | None:
        for node in self.node_pool():
            free = node not in self.blacklist and node not in self.used_nodes
            if free and self._down(node) is None:
                return node
        return None

    async def _retire(self, state: Pod, *, wait_for_exit: bool) -> None:
        proc = state.process
        if proc is None:
            return
        if wait_for_exit and proc.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), self.exit_wait_s)
        await self._stop(proc)

    async def _spawn(self, state: Pod) -> bool:
        """Start ``state``'s agent (False: the run killed its pods, none starts any more)."""
        if self.killed:
            return False
        assert self.job_token is not None
        token_file = nats_auth.write_pod_token(
            self.log_dir, self.job_token, self.namespace, self.job, state.name
        )
        state.incarnation += 1
        state.containers_on_node += 1
        self.used_nodes.add(state.node)
        if not await self._start(state, token_file):
            return False
        self.placements.append((state.name, state.node))
        return True

    def pod_log(self, state: Pod, what: str) -> Path:
        """The pod's log file, with a header line for this start (``what``: its incarnation)."""
        path = self.log_dir / "pods" / f"{state.name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as out:
            out.write(f"=== {state.name} {what} {state.incarnation} on {state.node}\n".encode())
        return path

    async def stop_all(self) -> None:
        """Wait (bounded) for the agents to exit on their own, then stop what is left."""
        self.stopping = True
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        procs = [p.process for p in self.pods.values() if p.process is not None]
        if procs:
            waits = [asyncio.wait_for(p.wait(), self.exit_wait_s) for p in procs]
            await asyncio.gather(*waits, return_exceptions=True)
        for proc in procs:
            await self._stop(proc)

    def agent_pids(self) -> dict[PodName, int]:
        return {name: p.process.pid for name, p in self.pods.items() if p.process is not None}

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro, name=self.task_name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("platform task crashed", exc_info=task.exception())
