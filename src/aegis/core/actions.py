"""Actions returned by ``step``: what the shells must do (imperative). A closed union."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aegis.core.model import NodeName, PodName
from aegis.core.phases import Order, Phase
from aegis.core.recovery import RecoveryLevel


@dataclass(frozen=True, slots=True)
class SendOrder:
    """Publish one order on the job's master subject. ``pods`` empty means every pod."""

    order: Order
    phase: Phase
    seq: int
    pods: tuple[PodName, ...] = ()
    exit_code: int = 0


@dataclass(frozen=True, slots=True)
class EvictPod:
    """Make the pod leave: its agent exits (code per level); the platform places a replacement."""

    pod: PodName
    level: RecoveryLevel
    exit_code: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReplacePod:
    """The pod is gone (lost heartbeat): the platform must create a replacement."""

    pod: PodName
    reason: str


@dataclass(frozen=True, slots=True)
class BlacklistNode:
    """Never place a pod of this job on ``node`` again (it joined ErrorNodes)."""

    node: NodeName
    reason: str


@dataclass(frozen=True, slots=True)
class RecordFault:
    """A fault was seen; ``counted`` says whether it spent fault budget."""

    pod: PodName
    reason: str
    counted: bool


@dataclass(frozen=True, slots=True)
class EndJob:
    """The job reached a terminal phase: stop everything, delete every pod."""

    phase: Phase
    reason: str


class RejectReason(enum.StrEnum):
    STALE = "stale"  # phase or seq of an earlier (or not yet started) round
    DUPLICATE = "duplicate"  # this pod already answered this round
    WRONG_PHASE = "wrong_phase"  # a message that means nothing in the current phase
    UNKNOWN_POD = "unknown_pod"
    TERMINAL = "terminal"  # the job is over
    IGNORED = "ignored"  # valid but changes nothing (e.g. a checkpoint with nobody to evict)


@dataclass(frozen=True, slots=True)
class Rejected:
    """The event left the status unchanged; says why."""

    reason: RejectReason
    detail: str = ""


Action = SendOrder | EvictPod | ReplacePod | BlacklistNode | RecordFault | EndJob | Rejected


def back_to_training(before: Phase, after: Phase, actions: tuple[Action, ...]) -> bool:
    """Whether a step brought the job back to training: into RunCommand from another phase, or
    a restart in place ordered from RunCommand itself (a software fault skips the checks)."""
    if after is not Phase.RUN_COMMAND:
        return False
    if before is not Phase.RUN_COMMAND:
        return True
    return any(isinstance(a, SendOrder) and a.order is Order.RESTART for a in actions)
