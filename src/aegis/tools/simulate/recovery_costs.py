"""What one interruption costs under each policy: detection, recovery, and where training resumes.

Aegis: the level the real core chose decides the cost (DESIGN section 6): in place (reload from
shared memory), container restart (same node, memory kept), node replacement or slow-node
eviction (a spare node, reload the newest checkpoint committed to disk). Each troubleshoot round
costs one round of checks. The baseline: NCCL timeout, relaunch everything, load from disk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aegis.core.model import JobSpec
from aegis.core.recovery import RecoveryLevel
from aegis.tools.simulate import faults
from aegis.tools.simulate.core_driver import CoreDriver, CoreOutcome
from aegis.tools.simulate.faults import FaultKind
from aegis.tools.simulate.settings import AegisSettings, BaselineSettings, SimSettings


class Policy(enum.StrEnum):
    AEGIS = "aegis"
    RESTART_FROM_CHECKPOINT = "restart-from-checkpoint"


class Rollback(enum.StrEnum):
    MEMORY = "memory"  # the newest saved checkpoint (shared memory, or disk for the baseline)
    DURABLE = "durable"  # the newest checkpoint committed to durable storage


@dataclass(frozen=True, slots=True)
class Cost:
    detection_s: float
    recovery_s: float
    rollback: Rollback


def detection_s(kind: FaultKind | None, settings: AegisSettings) -> float:
    """How long Aegis takes to notice a fault of this kind (None: a planned eviction)."""
    match kind:
        case None:
            return 0.0
        case FaultKind.NODE_LOST:
            return settings.detect_node_lost_s
        case FaultKind.HANG_RESTART | FaultKind.HANG_REPLACE | FaultKind.SLOW:
            return settings.detect_hang_s
        case _:
            return settings.detect_crash_s


def aegis_cost(kind: FaultKind | None, outcome: CoreOutcome, settings: AegisSettings) -> Cost:
    checks = outcome.rounds * settings.troubleshoot_s
    match outcome.level:
        case RecoveryLevel.IN_PLACE:
            move, load, rollback = settings.in_place_restart_s, settings.load_shm_s, Rollback.MEMORY
        case RecoveryLevel.CONTAINER:
            move, load, rollback = (
                settings.container_restart_s,
                settings.load_shm_s,
                Rollback.MEMORY,
            )
        case RecoveryLevel.NODE | RecoveryLevel.EVICT_SLOW:
            move, load, rollback = settings.node_replace_s, settings.load_disk_s, Rollback.DURABLE
    return Cost(detection_s(kind, settings), checks + move + load, rollback)


def baseline_cost(settings: BaselineSettings) -> Cost:
    return Cost(settings.detect_s, settings.relaunch_s + settings.load_disk_s, Rollback.DURABLE)


def mean_interruption_s(policy: Policy, settings: SimSettings) -> float:
    """Expected detection + recovery per fault over the cause mix (Daly's R), plus, for Aegis,
    the follow-up eviction at the next checkpoint and the durable copy's lag where it applies.
    Aegis's figure runs each kind once through the real core on a two-pod job."""
    if policy is Policy.RESTART_FROM_CHECKPOINT:
        cost = baseline_cost(settings.baseline)
        return cost.detection_s + cost.recovery_s
    total = 0.0
    for kind, share in faults.share_by_kind().items():
        driver = CoreDriver(JobSpec(job="mean", namespace="default", worker_num=2, max_retry=9))
        costs = [aegis_cost(kind, driver.fault(kind, 0, 0.0), settings.aegis)]
        follow_up = driver.checkpoint(1, 0.0)
        if follow_up is not None:
            costs.append(aegis_cost(None, follow_up, settings.aegis))
        for cost in costs:
            lag = settings.aegis.persist_s if cost.rollback is Rollback.DURABLE else 0.0
            total += share * (cost.detection_s + cost.recovery_s + lag)
    return total
