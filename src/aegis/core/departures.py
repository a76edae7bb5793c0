"""Pods that leave at a safe point: at a committed checkpoint the pods marked slow (or hung)
are evicted and blacklisted, and the pods of a drained node leave (no fault, no blacklist); a
drain can also stop waiting (pure)."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import rounds, updates
from aegis.core.model import JobStatus, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.core.rounds import Result


def on_checkpoint(status: JobStatus, now: float) -> Result:
    """At a committed checkpoint, pods marked slow (or hung) are evicted and blacklisted, and
    pods of a drained node leave (no fault, no blacklist)."""
    if status.phase is not Phase.RUN_COMMAND or status.slow_count + status.drain_count == 0:
        return rounds.reject(status, act.RejectReason.IGNORED, "no pod to evict at this checkpoint")
    leaving: dict[PodName, RecoveryLevel] = {}
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if info.drain:
                leaving[pod] = RecoveryLevel.DRAIN
            elif info.slow:
                leaving[pod] = RecoveryLevel.EVICT_SLOW
                pods[pod] = updates.pod(info, last_failed_reason=info.last_failed_reason or "slow")
        status = updates.status(status, pod_infos=pods.finish())
    return rounds.evict_running(status, leaving, now)


def on_drain(status: JobStatus, pods: tuple[PodName, ...], reason: str, now: float) -> Result:
    """Mark the pods of a drained node. In RunCommand they leave at the next committed
    checkpoint (the shell asks for one); in any other phase training is stopped, so they leave
    when the current round resolves. Nothing is counted."""
    marked = [
        pod
        for pod in dict.fromkeys(pods)
        if (info := status.pod_infos.get(pod)) is not None
        and not info.drain
        and not rounds.awaiting_replacement(info)
    ]
    if not marked:
        return rounds.reject(status, act.RejectReason.IGNORED, "no pod left to drain")
    with status.pod_infos.mutate() as infos:
        for pod in marked:
            infos[pod] = updates.pod(
                infos[pod], drain=True, last_failed_reason=f"drain: {reason}", updated_ts=now
            )
        pod_infos = infos.finish()
    status = updates.status(
        status, pod_infos=pod_infos, drain_count=status.drain_count + len(marked)
    )
    return status, ()


def on_drain_forced(
    status: JobStatus, pods: tuple[PodName, ...], reason: str, now: float
) -> Result:
    """The drain stops waiting for a checkpoint: its pods leave now (from RunCommand only;
    elsewhere they leave when the round resolves anyway)."""
    if status.phase is not Phase.RUN_COMMAND:
        return rounds.reject(
            status, act.RejectReason.IGNORED, f"drain waits for the {status.phase} round"
        )
    leaving = {
        pod: RecoveryLevel.DRAIN
        for pod in dict.fromkeys(pods)
        if (info := status.pod_infos.get(pod)) is not None and info.drain
    }
    if not leaving:
        return rounds.reject(status, act.RejectReason.IGNORED, "no draining pod")
    with status.pod_infos.mutate() as infos:
        for pod in leaving:
            info = infos[pod]
            infos[pod] = updates.pod(
                info, last_failed_reason=f"{info.last_failed_reason} ({reason})"
            )
        status = updates.status(status, pod_infos=infos.finish())
    return rounds.evict_running(status, leaving, now)
