"""The building blocks of the job's transitions: a new round, Restarting, the end of the job,
pods that leave their node, and the counters every one of them keeps consistent (pure).

``machine`` and its rule modules call these through the module (``rounds.start_round``), so the
model checker's mutants can replace one of them for every caller at once.
"""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import updates
from aegis.core.model import ErrorNode, JobSpec, JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import Order, Phase
from aegis.core.recovery import (
    CONTAINER_RESTART_EXIT_CODE,
    JOB_FAILED_EXIT_CODE,
    NODE_BAD_EXIT_CODE,
    RecoveryLevel,
)

Result = tuple[JobStatus, tuple[act.Action, ...]]
PodMap = updates.PodMap


def reject(status: JobStatus, reason: act.RejectReason, detail: str = "") -> Result:
    return status, (act.Rejected(reason=reason, detail=detail),)


def start_round(
    status: JobStatus, phase: Phase, order: Order, now: float
) -> tuple[JobStatus, tuple[act.Action, ...]]:
    """A new round: bump seq, every pod enters ``phase`` unfinished, one order to all."""
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            pods[pod] = updates.pod(
                info, inner_phase=phase, finished=False, verdict=None, evict=None, updated_ts=now
            )
        pod_infos = pods.finish()
    seq = status.seq + 1
    status = updates.status(
        status,
        phase=phase,
        seq=seq,
        pod_infos=pod_infos,
        outstanding=len(pod_infos),
        away=0,
    )
    return status, (act.SendOrder(order, phase, seq),)


def enter_restarting(status: JobStatus, leaving: dict[PodName, Phase], now: float) -> JobStatus:
    """Restarting: the leaving pods are away, the others present (finished) and idle."""
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if pod in leaving:
                pods[pod] = updates.pod(
                    info, inner_phase=leaving[pod], finished=False, verdict=None, updated_ts=now
                )
            else:
                pods[pod] = updates.pod(
                    info, inner_phase=Phase.RESTARTING, finished=True, verdict=None, updated_ts=now
                )
        pod_infos = pods.finish()
    return updates.status(
        status,
        phase=Phase.RESTARTING,
        seq=status.seq + 1,
        pod_infos=pod_infos,
        outstanding=len(leaving),
        away=len(leaving),
    )


def end(status: JobStatus, phase: Phase, reason: str, now: float) -> Result:
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            pods[pod] = updates.pod(info, inner_phase=phase, finished=True, updated_ts=now)
        pod_infos = pods.finish()
    seq = status.seq + 1
    status = updates.status(
        status, phase=phase, seq=seq, pod_infos=pod_infos, outstanding=0, away=0
    )
    code = 0 if phase is Phase.SUCCEED else JOB_FAILED_EXIT_CODE
    return status, (
        act.SendOrder(Order.EXIT, phase, seq, exit_code=code),
        act.EndJob(phase=phase, reason=reason),
    )


def fail(
    spec: JobSpec, status: JobStatus, reason: str, now: float, *, budget_spent: bool
) -> Result:
    """Transitions 8 (budget exhausted) and 9 (should_quit from outside)."""
    rc = spec.max_retry + 1 if budget_spent else status.recover_count
    status = updates.status(status, recover_count=rc, should_quit=True)
    return end(status, Phase.FAILED, reason, now)


def evict(
    status: JobStatus, leaving: dict[PodName, RecoveryLevel], now: float, *, phase: Phase
) -> Result:
    """Make pods leave. In Troubleshooting the job waits in Restarting; in BootChecking it stays
    BootChecking and starts a new round when they are back."""
    actions: list[act.Action] = []
    error_nodes = status.error_nodes
    for pod, level in sorted(leaving.items()):
        info = status.pod_infos[pod]
        if info.slow or info.drain:  # marks belong to the node it leaves, not its replacement
            status = updates.status(
                status,
                pod_infos=status.pod_infos.set(pod, updates.pod(info, slow=False, drain=False)),
                slow_count=status.slow_count - info.slow,
                drain_count=status.drain_count - info.drain,
            )
        reason = info.last_failed_reason or (info.verdict.value if info.verdict else "evicted")
        code = (
            CONTAINER_RESTART_EXIT_CODE if level is RecoveryLevel.CONTAINER else NODE_BAD_EXIT_CODE
        )
        actions.append(act.EvictPod(pod=pod, level=level, exit_code=code, reason=reason))
        if level not in (RecoveryLevel.CONTAINER, RecoveryLevel.DRAIN):
            error_nodes = add_error_node(error_nodes, info.node, reason, now)
            actions.append(act.BlacklistNode(node=info.node, reason=reason))
    status = updates.status(status, error_nodes=error_nodes)
    if phase is Phase.RESTARTING:
        return enter_restarting(status, dict.fromkeys(leaving, Phase.RESTARTING), now), tuple(
            actions
        )
    with status.pod_infos.mutate() as pods:
        for pod, level in leaving.items():
            pods[pod] = updates.pod(
                pods[pod], inner_phase=Phase.RESTARTING, finished=False, evict=level, updated_ts=now
            )
        pod_infos = pods.finish()
    status = updates.status(
        status,
        pod_infos=pod_infos,
        outstanding=status.outstanding + len(leaving),
        away=status.away + len(leaving),
    )
    return status, tuple(actions)


def is_error_node(nodes: tuple[ErrorNode, ...], node: str) -> bool:
    return any(entry.node == node for entry in nodes)


def add_error_node(
    nodes: tuple[ErrorNode, ...], node: NodeName, reason: str, now: float
) -> tuple[ErrorNode, ...]:
    if is_error_node(nodes, node):
        return nodes
    return (*nodes, ErrorNode(node=node, reason=reason, ts=now))


def align_retries(status: JobStatus) -> PodMap:
    """Back to RunCommand: every pod's retries = recover_count (one down, all down)."""
    rc = status.recover_count
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if info.retries != rc:
                pods[pod] = updates.pod(info, retries=rc)
        aligned = pods.finish()
    return aligned


def budget_exhausted(spec: JobSpec, status: JobStatus) -> bool:
    return any(info.retries > spec.max_retry for info in status.pod_infos.values())


def replace_elsewhere(
    status: JobStatus, pod: PodName, info: PodInfo, reason: str, now: float
) -> Result:
    """A pod asked to come back that did not join in time goes elsewhere, awaiting its
    replacement again: placed and not ACKed, its node is an error node (it could not reach
    the master from there); never placed, the replacement is asked for again (the node it left
    may only have been drained). The fault that sent it away was counted; the phase and the
    round stay. A pod that is present is not away: rejected."""
    if info.finished or info.inner_phase not in (Phase.PENDING, Phase.RESTARTING):
        return reject(status, act.RejectReason.IGNORED, f"{pod} is not away")
    placed = info.inner_phase is Phase.PENDING
    away = updates.pod(info, inner_phase=Phase.RESTARTING, evict=None, last_failed_reason=reason,
                       updated_ts=now)  # fmt: skip
    status = updates.status(status, pod_infos=status.pod_infos.set(pod, away))
    record, replace = act.RecordFault(pod, reason, counted=False), act.ReplacePod(pod, reason)
    if not placed:
        return status, (record, replace)
    nodes = add_error_node(status.error_nodes, info.node, reason, now)
    blacklist = act.BlacklistNode(node=info.node, reason=reason)
    return updates.status(status, error_nodes=nodes), (record, blacklist, replace)


def node_down(status: JobStatus, node: NodeName, reason: str, now: float) -> Result:
    """A node found down joins ErrorNodes and is blacklisted; the phase, the round and the
    budget stay. A node already there, or no node named: rejected."""
    if not node or is_error_node(status.error_nodes, node):
        return reject(status, act.RejectReason.IGNORED, f"node {node!r} is known")
    nodes = add_error_node(status.error_nodes, node, reason, now)
    return updates.status(status, error_nodes=nodes), (act.BlacklistNode(node, reason),)


def awaiting_replacement(info: PodInfo) -> bool:
    return info.inner_phase is Phase.RESTARTING and not info.finished


def evict_running(status: JobStatus, leaving: dict[PodName, RecoveryLevel], now: float) -> Result:
    """Pods leave a running job: every pod stops training, the job waits in Restarting."""
    evicted, actions = evict(status, leaving, now, phase=Phase.RESTARTING)
    stop = act.SendOrder(Order.STOP, Phase.RESTARTING, evicted.seq)
    return evicted, (stop, *actions)


def mark_slow(status: JobStatus, pod: PodName, info: PodInfo) -> JobStatus:
    if info.slow:
        return status
    return updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, updates.pod(info, slow=True)),
        slow_count=status.slow_count + 1,
    )
