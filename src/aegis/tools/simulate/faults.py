"""Fault traces: when faults happen, their root cause, and what Aegis does about each cause.

``llama3``: the root-cause mix and rate of the Llama 3 paper (arXiv 2407.21783, section 3.3.4,
Table 5): 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (2,048 nodes of 8),
scaled linearly with the node count. The mix is the table's counts, which sum to 419 (its
percentages do not quite: "faulty GPU" reads 30.1 % beside a count of 148, i.e. 35.3 %; with the
percentages the rows sum to 94.4 %).
``exponential``: the same mix of causes at a given job MTBF (Poisson arrivals), the model of Young
and Daly. Faults arrive in wall time whatever the job is doing (running, checkpointing, recovering).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 2048  # 16,384 GPUs at 8 per node
DAY_S = 86_400.0


class FaultKind(enum.StrEnum):
    """How a fault shows itself to Aegis and what the checks then say (DESIGN sections 5, 6)."""

    CRASH_RESTART = "crash, checks pass -> in-place restart"
    CRASH_CONTAINER = "crash, runtime broken -> container restart"
    CRASH_REPLACE = "crash, hardware check fails -> node replacement"
    HANG_RESTART = "hang, checks pass -> in-place restart, eviction at next checkpoint"
    HANG_REPLACE = "hang, network check fails -> node replacement"
    SLOW = "stall, perf check slow -> in-place restart, eviction at next checkpoint"
    NODE_LOST = "node lost (heartbeat) -> node replacement"


@dataclass(frozen=True, slots=True)
class Cause:
    name: str
    count: int  # interruptions of this cause, Llama 3, Table 5
    kind: FaultKind


LLAMA3_CAUSES: tuple[Cause, ...] = (
    Cause("faulty GPU", 148, FaultKind.CRASH_REPLACE),  # Xid / CUDA error, gpu check fails
    Cause("GPU HBM3 memory", 72, FaultKind.CRASH_REPLACE),  # uncorrectable ECC
    Cause("software bug", 54, FaultKind.CRASH_RESTART),  # the process dies, the node is fine
    Cause("network switch/cable", 35, FaultKind.HANG_REPLACE),  # collectives stall; rdma fails
    Cause("host maintenance", 32, FaultKind.NODE_LOST),  # unplanned: the host goes away
    Cause("GPU SRAM memory", 19, FaultKind.CRASH_REPLACE),
    Cause("GPU system processor", 17, FaultKind.CRASH_REPLACE),
    Cause("NIC", 7, FaultKind.HANG_REPLACE),
    Cause("NCCL watchdog timeouts", 7, FaultKind.HANG_RESTART),
    Cause("silent data corruption", 6, FaultKind.CRASH_REPLACE),  # loss spike, gpu diag fails
    Cause("GPU thermal interface + sensor", 6, FaultKind.SLOW),  # throttling: a slow node
    Cause("SSD", 3, FaultKind.CRASH_REPLACE),  # io check fails
    Cause("power supply", 3, FaultKind.NODE_LOST),
    Cause("server chassis", 2, FaultKind.NODE_LOST),
    Cause("IO expansion board", 2, FaultKind.CRASH_REPLACE),
    Cause("dependency", 2, FaultKind.CRASH_CONTAINER),  # runtime/environment broken
    Cause("CPU", 2, FaultKind.NODE_LOST),
    Cause("system memory", 2, FaultKind.NODE_LOST),
)


class TraceKind(enum.StrEnum):
    LLAMA3 = "llama3"
    EXPONENTIAL = "exponential"


@dataclass(frozen=True, slots=True)
class TraceSpec:
    kind: TraceKind
    nodes: int
    horizon_s: float
    mtbf_s: float | None = None  # exponential only: the job's MTBF

    def job_mtbf_s(self) -> float:
        """The mean time between faults of the whole job."""
        if self.kind is TraceKind.EXPONENTIAL:
            if self.mtbf_s is None or self.mtbf_s <= 0:
                raise ValueError("the exponential trace needs a positive MTBF")
            return self.mtbf_s
        per_node_rate = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * DAY_S * LLAMA3_NODES)
        return 1.0 / (per_node_rate * self.nodes)


@dataclass(frozen=True, slots=True)
class Fault:
    time_s: float
    cause: Cause
    node: int  # index of the node (and pod) that fails


def generate(spec: TraceSpec, rng: random.Random) -> tuple[Fault, ...]:
    """Poisson arrivals at the job's fault rate over the horizon; causes drawn from the mix."""
    mtbf = spec.job_mtbf_s()
    weights = [cause.count for cause in LLAMA3_CAUSES]
    faults: list[Fault] = []
    t = rng.expovariate(1.0 / mtbf)
    while t < spec.horizon_s:
        cause = rng.choices(LLAMA3_CAUSES, weights=weights)[0]
        faults.append(Fault(time_s=t, cause=cause, node=rng.randrange(spec.nodes)))
        t += rng.expovariate(1.0 / mtbf)
    return tuple(faults)


def share_by_kind() -> dict[FaultKind, float]:
    """Fraction of faults of each kind in the (normalised) mix."""
    total = sum(cause.count for cause in LLAMA3_CAUSES)
    shares = dict.fromkeys(FaultKind, 0.0)
    for cause in LLAMA3_CAUSES:
        shares[cause.kind] += cause.count / total
    return shares
