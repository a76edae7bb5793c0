"""A node's drain as a job sees it: which of its pods leave (pure), the platforms' side of a
drain (ports), and a drain that a pod's own GPUs ask for (``agent.health``).

``aegis ctl drain`` (``control``) and a health drain move pods the same way: the pods on the
node leave at the next committed checkpoint (requested now) or at the drain's deadline, no
fault counted. ``aegis ctl drain`` keeps the node out of the platforms' placements (drained in
the scheduler where there is one: Slurm) until ``undrain``. A health drain puts the node in the
job's ErrorNodes (``NodeDown``: kept in the job's record, so a new leader and every platform
know it; Slurm drains it too, as it does every node found bad). It names the node by the
master's own record of where the pod runs, never by the pod's word (a report naming another
node is refused), and is made once per node: the pod's agent says its warnings at each look
while they stand.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aegis.core.model import JobStatus, NodeName, PodName
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.rounds import is_error_node
from aegis.wire import messages as m
from aegis.wire.logsafe import one_line

REASON_CHARS = 300  # what of the warnings a health drain's reason carries
HEALTH_REASON = "GPU health of "  # how a health drain's reason starts (NodeDown, DrainRequested)


@runtime_checkable
class NodeBlacklist(Protocol):
    """What ``taint``/``untaint`` and a drain need from a platform (``LocalPlatform`` has it)."""

    blacklist: dict[str, str]


@runtime_checkable
class NodeDrainer(Protocol):
    """A platform that also drains nodes in its scheduler (Slurm: ``scontrol``)."""

    async def drain_node(self, node: str, reason: str) -> None: ...

    async def undrain_node(self, node: str) -> None: ...


def pods_on(status: JobStatus, nodes: Collection[str]) -> tuple[PodName, ...]:
    """The pods of a running job on these nodes that are not leaving already."""
    if status.phase in TERMINAL_PHASES:
        return ()
    return tuple(
        PodName(pod)
        for pod, info in status.pod_infos.items()
        if info.node in nodes
        and not info.drain
        and not (info.inner_phase is Phase.RESTARTING and not info.finished)
    )


@dataclass(frozen=True, slots=True)
class HealthDrain:
    node: NodeName
    pods: tuple[PodName, ...]
    reason: str


def health_drain(status: JobStatus, pod: PodName, report: m.HealthData) -> HealthDrain | None:
    """The drain ``pod``'s GPU warnings ask for: its node as the master placed it, the job's
    pods there. None when the job ended, the pod is unknown, the report names another node
    (an agent of an earlier placement), the node is in ErrorNodes already (drained once, or
    found bad) or no pod of the job stays there."""
    info = status.pod_infos.get(pod)
    if status.phase in TERMINAL_PHASES or info is None or not info.node:
        return None
    if names_another_node(status, pod, report) or is_error_node(status.error_nodes, info.node):
        return None
    pods = pods_on(status, {info.node})
    if not pods:
        return None
    said = one_line("; ".join(report.warnings), REASON_CHARS)
    return HealthDrain(info.node, pods, f"{HEALTH_REASON}{info.node} ({pod}): {said}")


def names_another_node(status: JobStatus, pod: PodName, report: m.HealthData) -> bool:
    """Whether the report names a node other than the one the master placed ``pod`` on (an
    agent of an earlier placement, or one that lies): refused, and counted as a drop."""
    info = status.pod_infos.get(pod)
    return bool(report.node) and info is not None and report.node != info.node


DRAINED = "drained: "  # how a drained node's reason starts in a platform's blacklist


async def keep_out(platform: object, node: str, reason: str) -> None:
    """``node`` out of the platform's placements (and drained in its scheduler, if any)."""
    if isinstance(platform, NodeBlacklist):
        platform.blacklist[node] = DRAINED + reason
    if isinstance(platform, NodeDrainer):
        await platform.drain_node(node, reason)
