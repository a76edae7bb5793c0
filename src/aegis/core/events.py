"""Events fed to ``step``: what happened (past tense). A closed union dispatched with ``match``.

Messages from agents carry the round they answer (``phase``, ``seq``); platform and operator
events (heartbeat lost, pod restarted, quit requested, checkpoint committed) carry none.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegis.core.model import NodeName, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification


@dataclass(frozen=True, slots=True)
class PodAcked:
    """The pod's agent subscribed to its job's orders (sent once per agent incarnation);
    ``pod_ip``: the address it says its peers reach it at (None: it did not say)."""

    pod: PodName
    pod_ip: str | None = None


@dataclass(frozen=True, slots=True)
class ChecksReported:
    """The pod finished a bootcheck or troubleshoot round; its check results, classified."""

    pod: PodName
    phase: Phase
    seq: int
    verdict: Classification
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PodFinished:
    """The pod's training command exited with ``exit_code``."""

    pod: PodName
    phase: Phase
    seq: int
    exit_code: int


@dataclass(frozen=True, slots=True)
class PodErrored:
    """The pod's agent reported an error (matched log signature, crash, failed check run).
    ``fault_class``: the log scanner's class of it (``""``: no signature matched)."""

    pod: PodName
    phase: Phase
    seq: int
    reason: str
    fault_class: str = ""
    step: int | None = None  # the training's last step when it failed (None: unknown)


@dataclass(frozen=True, slots=True)
class HangReported:
    """The pod's agent saw no progress for its hang timeout (processes are left running).
    ``blame``: the pod is the one the hang is about (the master named it from every pod's
    stacks, ``core.suspects``), so it is marked slow (it leaves at the next commit); False when
    no pod could be singled out: the fault is counted, nobody is marked."""

    pod: PodName
    phase: Phase
    seq: int
    reason: str = "hang"
    blame: bool = True


@dataclass(frozen=True, slots=True)
class HeartbeatLost:
    """The shell saw no heartbeat from the pod for the heartbeat timeout: the pod is gone."""

    pod: PodName


@dataclass(frozen=True, slots=True)
class JoinTimedOut:
    """The shell heard nothing from a pod asked to come back (replaced, or restarted) within
    the join timeout: its node cannot reach the master (a partition) or the pod never started.
    Its node is blacklisted and the pod placed elsewhere; nothing more is counted."""

    pod: PodName
    reason: str = "did not come back"


@dataclass(frozen=True, slots=True)
class NodeDown:
    """The platform found ``node`` itself gone (its host, not one of its pods), or a pod's
    agent found its GPUs about to fail (a health drain, ``master.node_drains``): it joins
    ErrorNodes and takes no pod again. Nothing is counted: the loss of its pod was, and a
    health drain's pods leave at a checkpoint."""

    node: NodeName
    reason: str = "node down"


@dataclass(frozen=True, slots=True)
class PodRestarted:
    """The platform saw the pod's container restart or a replacement pod start (maybe elsewhere)."""

    pod: PodName
    node: NodeName | None = None
    pod_ip: str | None = None


@dataclass(frozen=True, slots=True)
class QuitRequested:
    """``should_quit`` was set from outside (a user or operator stopped the job)."""

    reason: str = "stopped by user"


@dataclass(frozen=True, slots=True)
class CheckpointCommitted:
    """A checkpoint was safely committed: the safe point for evicting slow pods."""

    step: int


@dataclass(frozen=True, slots=True)
class DrainRequested:
    """The operator drains the node of these pods (planned maintenance): they leave at the next
    committed checkpoint, which the shell asks the job for; no fault is counted."""

    pods: tuple[PodName, ...]
    reason: str = "drained"


@dataclass(frozen=True, slots=True)
class DrainForced:
    """Stop waiting for a checkpoint: the draining pods among ``pods`` leave now (the drain's
    deadline passed, or the training script does not take checkpoints on request)."""

    pods: tuple[PodName, ...]
    reason: str = "drain deadline passed"


@dataclass(frozen=True, slots=True)
class SlowdownReported:
    """The shell saw the job's training step rate fall well below the pace it kept earlier in
    the same run. Not a fault: the troubleshooting round it starts (allreduce_perf) finds
    which node, if any, is slow; that pod is marked and leaves at the next checkpoint."""

    reason: str = "training slowed down"


Event = (
    PodAcked
    | ChecksReported
    | PodFinished
    | PodErrored
    | HangReported
    | HeartbeatLost
    | JoinTimedOut
    | NodeDown
    | PodRestarted
    | QuitRequested
    | CheckpointCommitted
    | DrainRequested
    | DrainForced
    | SlowdownReported
)

# Events that answer a round: they carry (phase, seq) and are stale when these do not match.
RoundMessage = ChecksReported | PodFinished | PodErrored | HangReported
