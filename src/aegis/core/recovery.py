"""Classification of check results and the recovery level each class leads to (DESIGN section 6).

This is data the master consumes: the core's ``step`` reads ``LEVEL_BY_CLASS`` when it resolves a
round of troubleshooting, and ``classify`` turns a pod's check results into one class.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class CheckType(enum.StrEnum):
    IO = "io"
    GPU = "gpu"
    RUNTIME = "runtime"
    RDMA = "rdma"
    ALLREDUCE_CONNECT = "allreduce_connect"
    ALLREDUCE_PERF = "allreduce_perf"
    HANG = "hang"


class Classification(enum.StrEnum):
    HEALTHY = "healthy"  # every check passed: the process died on its own
    RUNTIME = "runtime"  # environment/runtime broken: restart the container
    HARDWARE = "hardware"  # gpu/rdma/io/network broken: move off the node, blacklist it
    SLOW = "slow"  # alive but slow or hung: mark, evict at the next checkpoint


class RecoveryLevel(enum.IntEnum):
    IN_PLACE = 1  # restart the training processes in place, all pods
    CONTAINER = 2  # the pod's agent exits with the restart code; same node
    NODE = 3  # the pod exits 1, its node joins ErrorNodes, a replacement runs elsewhere
    EVICT_SLOW = 4  # marked now, evicted at the next committed checkpoint, node blacklisted
    DRAIN = 5  # planned (aegis ctl drain): leaves at the next checkpoint, not a fault; the
    # node is drained by the operator, not recorded as an error node


# One name per level, for the fault log, the metrics and ``aegis incidents`` alike.
LEVEL_NAMES: dict[RecoveryLevel, str] = {
    RecoveryLevel.IN_PLACE: "in_place",
    RecoveryLevel.CONTAINER: "container",
    RecoveryLevel.NODE: "node_replaced",
    RecoveryLevel.EVICT_SLOW: "slow_evicted",
    RecoveryLevel.DRAIN: "drained",
}


LEVEL_BY_CLASS: dict[Classification, RecoveryLevel] = {
    Classification.HEALTHY: RecoveryLevel.IN_PLACE,
    Classification.RUNTIME: RecoveryLevel.CONTAINER,
    Classification.HARDWARE: RecoveryLevel.NODE,
    Classification.SLOW: RecoveryLevel.EVICT_SLOW,
}


def must_leave(cls: Classification) -> bool:
    """A class whose pod leaves now (its container restarts, or it moves off its node) whatever
    the other pods' checks say: the checks of its peers cannot change that decision."""
    return LEVEL_BY_CLASS[cls] in (RecoveryLevel.CONTAINER, RecoveryLevel.NODE)


# Which class a failing check puts its pod in. The worst class wins (order of SEVERITY).
CLASS_BY_FAILED_CHECK: dict[CheckType, Classification] = {
    CheckType.IO: Classification.HARDWARE,
    CheckType.GPU: Classification.HARDWARE,
    CheckType.RDMA: Classification.HARDWARE,
    CheckType.ALLREDUCE_CONNECT: Classification.HARDWARE,
    CheckType.RUNTIME: Classification.RUNTIME,
    CheckType.ALLREDUCE_PERF: Classification.SLOW,
    CheckType.HANG: Classification.SLOW,
}

SEVERITY: tuple[Classification, ...] = (
    Classification.HEALTHY,
    Classification.SLOW,
    Classification.RUNTIME,
    Classification.HARDWARE,
)


class FaultClass(enum.StrEnum):
    """The known classes of fault signature (the agent's log scanner), most specific (hardware)
    first: the order is the rank. A signature file may name classes of its own: on the wire and
    in events a class is its string, and an unknown one ranks just before a bare traceback."""

    GPU_XID = "gpu_xid"
    GPU_ECC = "gpu_ecc"
    CUDA_OOM = "cuda_oom"
    NCCL_TIMEOUT = "nccl_timeout"
    NCCL_ERROR = "nccl_error"
    CUDA_ERROR = "cuda_error"
    HOST_OOM = "host_oom"
    IO_ERROR = "io_error"
    CONNECTION = "connection"
    SEGFAULT = "segfault"
    KILLED = "killed"
    PYTHON_TRACEBACK = "python_traceback"


def fault_rank(fault_class: str) -> int:
    """Lower is more telling; classes from a config file rank just before a bare traceback."""
    order = list(FaultClass)
    try:
        return order.index(FaultClass(fault_class))
    except ValueError:
        return order.index(FaultClass.PYTHON_TRACEBACK) - 1


# Fault classes (the agent's log scanner) that name a software cause: a plain Python exception,
# with no hardware, CUDA, NCCL, network or memory signature in the log. The checks cannot find
# anything a restart would not, so the job restarts in place at once, without a troubleshooting
# round (the fault is counted all the same). An exit with no signature, a signal, a hang or a
# lost pod still gets the round.
SOFTWARE_FAULT_CLASSES: frozenset[str] = frozenset({FaultClass.PYTHON_TRACEBACK})

# Fault classes that another pod's fault causes: when one rank dies, its peers see their
# connections close or their collectives time out, and such a report may reach the master
# before the one that names the cause.
CONSEQUENTIAL_FAULT_CLASSES: frozenset[str] = frozenset(
    {FaultClass.CONNECTION, FaultClass.NCCL_TIMEOUT}
)

Run = tuple[int, str, int]  # the same fault in a row: (step, what it said, how many times)
NO_RUN: Run = (-1, "", 0)


def run_after(run: Run, step: int | None, reason: str, fault_class: str) -> Run:
    """The run of the same fault after one more error (restart or stop). A fault at no known
    step ends the run. A consequential fault at the run's step continues it, and says nothing
    of what the fault was (``""`` when it starts a run): it is the same incarnation's crash
    seen by a peer first. A fault that names itself continues a run at its step that said the
    same, or that only consequential faults made; anything else starts a run of one."""
    last_step, said, count = run
    if step is None:
        return NO_RUN
    consequential = fault_class in CONSEQUENTIAL_FAULT_CLASSES
    if count == 0 or step != last_step:
        return step, "" if consequential else reason, 1
    if consequential:
        return step, said, count + 1
    return step, reason, count + 1 if said in ("", reason) else 1


# Exit code of an agent told to restart its container (level 2); level 3 exits 1.
CONTAINER_RESTART_EXIT_CODE = 75
NODE_BAD_EXIT_CODE = 1


@dataclass(frozen=True, slots=True)
class CheckOutcome:
    """The part of a check result the classification needs."""

    check_type: CheckType
    passed: bool
    timed_out: bool = False  # failed by overrunning its budget


def classify(outcomes: Iterable[CheckOutcome]) -> Classification:
    """The class of one pod from its check outcomes: the most severe failing check decides.
    A runtime check that only ran out of time says the node is slow, not that its environment
    is broken: restarting the container on the same node would fail the same way, forever."""
    worst = Classification.HEALTHY
    for outcome in outcomes:
        if outcome.passed:
            continue
        cls = CLASS_BY_FAILED_CHECK[outcome.check_type]
        if outcome.timed_out and cls is Classification.RUNTIME:
            cls = Classification.SLOW
        if SEVERITY.index(cls) > SEVERITY.index(worst):
            worst = cls
    return worst


# Exit code the master gives every agent when the job has Failed (the platform deletes the pods;
# distinct from NODE_BAD_EXIT_CODE so that no platform mistakes it for a bad node).
JOB_FAILED_EXIT_CODE = 3
