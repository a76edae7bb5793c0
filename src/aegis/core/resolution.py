"""How a round of checks resolves (DESIGN section 3, transitions 3 and 8; pure)."""

from __future__ import annotations

from aegis.core import rounds, updates
from aegis.core.model import JobSpec, JobStatus, PodInfo, PodName
from aegis.core.phases import Order, Phase
from aegis.core.recovery import LEVEL_BY_CLASS, Classification, RecoveryLevel, must_leave
from aegis.core.rounds import Result


def resolve_bootcheck(spec: JobSpec, status: JobStatus, now: float) -> Result:
    """Transition 3: all PASS -> RunCommand; a failing pod exits (not counted) and is replaced,
    after which a fresh bootcheck round runs for everybody."""
    leaving = {
        pod: bootcheck_level(info.verdict)
        for pod, info in status.pod_infos.items()
        if info.verdict is not Classification.HEALTHY
    }
    for pod, info in status.pod_infos.items():
        if info.drain:
            leaving[pod] = drain_level(leaving.get(pod, RecoveryLevel.IN_PLACE))
    if not leaving:
        return rounds.start_round(status, Phase.RUN_COMMAND, Order.RUN, now)
    return rounds.evict(status, leaving, now, phase=Phase.BOOT_CHECKING)


def bootcheck_level(verdict: Classification | None) -> RecoveryLevel:
    # Before training nothing is lost by moving: a slow node leaves at once.
    if verdict is Classification.RUNTIME:
        return RecoveryLevel.CONTAINER
    return RecoveryLevel.NODE


def drain_level(level: RecoveryLevel) -> RecoveryLevel:
    """A draining pod leaves its node in any case; only a bad node (level 3) says more."""
    return level if level is RecoveryLevel.NODE else RecoveryLevel.DRAIN


def concludes_early(status: JobStatus, info: PodInfo, verdict: Classification) -> bool:
    """The suspect's node is checked first: a troubleshooting round ends as soon as a suspect (a
    pod marked slow or hung, e.g. the pod a hang's stacks named) answers that it must leave (its
    node or its container is broken). Its peers' answers cannot change that, and waiting for them
    would cost their collective checks' budgets (their group waits for the suspect's rank, which
    does not join once its own node failed): their late answers are stale. Not while a pod is
    away (lost during the round, its replacement asked for): the round waits for it as ever."""
    return (
        status.phase is Phase.TROUBLESHOOTING
        and status.away == 0
        and info.slow
        and must_leave(verdict)
    )


def resolve_troubleshooting(spec: JobSpec, status: JobStatus, now: float) -> Result:
    """Transition 8: budget exhausted -> Failed; a pod must exit -> Restarting; else restart
    every pod in place (RunCommand) with retries aligned to recover_count."""
    if rounds.budget_exhausted(spec, status):
        return rounds.fail(spec, status, "fault budget exhausted", now, budget_spent=True)
    leaving: dict[PodName, RecoveryLevel] = {}
    for pod, info in status.pod_infos.items():
        if info.drain:  # training is stopped: nothing is lost by leaving now (answered or
            # not: a round its suspect ended early)
            verdict = info.verdict or Classification.HEALTHY
            leaving[pod] = drain_level(LEVEL_BY_CLASS[verdict])
            continue
        if info.verdict is None:
            continue
        level = LEVEL_BY_CLASS[info.verdict]
        if level is RecoveryLevel.EVICT_SLOW:
            status = rounds.mark_slow(status, pod, info)
        elif level is not RecoveryLevel.IN_PLACE:
            leaving[pod] = level
    if leaving:
        return rounds.evict(status, leaving, now, phase=Phase.RESTARTING)
    status = updates.status(status, pod_infos=rounds.align_retries(status))
    return rounds.start_round(status, Phase.RUN_COMMAND, Order.RESTART, now)
