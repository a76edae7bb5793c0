"""The job's desired state (``JobSpec``) and observed state (``JobStatus``), as in the seed's CR.

Field names follow DESIGN section 3. ``pod_infos`` is a persistent (HAMT) map, so changing one pod
costs O(log pods), not a copy of the whole job; the round counters kept beside it (``outstanding``,
``slow_count``) let ``step`` decide phase changes without scanning every pod.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

import immutables

from aegis.core.errors import AegisError
from aegis.core.phases import Phase
from aegis.core.recovery import Classification, RecoveryLevel

PodName = NewType("PodName", str)
NodeName = NewType("NodeName", str)


# One rule for job and namespace names (Kubernetes DNS labels): lowercase letters, digits and
# '-', beginning and ending with a letter or digit, at most 63 characters. No '.', '*' or '>'
# (NATS subject tokens), so no job's subjects can be a prefix of another's.
NAME_MAX = 63
POD_NAME_MAX = 253  # a pod's name is the job's and a suffix: Kubernetes allows 253
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class InvalidNameError(AegisError, ValueError):
    """A job or namespace name outside the one rule (``name_problem``)."""


def incident_id(job: str, number: int) -> str:
    """``demo#2``: the job's second incident. No pod or job name has a ``#`` (pods are
    ``demo-0``, ``demo-1``..., DNS labels), so an id never reads as a pod's name; the fault log
    (``master.faultlog``) and ``aegis incidents`` (``tools.incidents``) both use it, so ids
    agree."""
    return f"{job}#{number}"


def name_problem(kind: str, name: str, max_len: int = NAME_MAX) -> str | None:
    """Why ``name`` cannot be a job's (``kind``: "job" or "namespace") name, or with
    ``max_len=POD_NAME_MAX`` a pod's; None when it can."""
    shown = repr(name[: max_len + 1]) + ("..." if len(name) > max_len + 1 else "")
    if len(name) > max_len:
        return f"{kind} name {shown} is longer than {max_len} characters"
    if not _NAME.fullmatch(name):
        return (
            f"{kind} name {shown} is not a DNS label (lowercase letters, digits and '-', "
            "beginning and ending with a letter or digit)"
        )
    return None


def check_names(namespace: str, job: str) -> None:
    """Raises ``InvalidNameError`` unless both names follow the rule."""
    problem = name_problem("namespace", namespace) or name_problem("job", job)
    if problem is not None:
        raise InvalidNameError(problem)


@dataclass(frozen=True, slots=True)
class JobSpec:
    job: str
    namespace: str
    worker_num: int
    max_retry: int
    # A fault the log names as software (a plain Python exception) restarts every pod in place
    # at once, without a troubleshooting round. False: every fault gets the round (the rule of
    # the jobs logged before this existed: their event logs replay with it).
    software_restart: bool = True
    # Restart or stop: the same error (reason) at the same step in this many incarnations in a
    # row ends the job Failed at once (a deterministic bug, a corrupt sample: no restart fixes
    # it, and the rest of the budget would be spent for nothing). 0: never (the rule of the
    # jobs logged before this existed).
    repeat_limit: int = 3

    def __post_init__(self) -> None:
        if self.worker_num < 1:
            raise ValueError(f"worker_num must be >= 1, got {self.worker_num}")
        if self.max_retry < 0:
            raise ValueError(f"max_retry must be >= 0, got {self.max_retry}")
        if self.repeat_limit < 0:
            raise ValueError(f"repeat_limit must be >= 0, got {self.repeat_limit}")


@dataclass(frozen=True, slots=True)
class ErrorNode:
    node: NodeName
    reason: str
    ts: float


@dataclass(frozen=True, slots=True)
class PodInfo:
    """One pod as the master sees it.

    ``finished``: the pod has done what the current round asks (ACKed in Pending, answered the
    checks in BootChecking/Troubleshooting, exited 0 in RunCommand, is present in Restarting).
    ``seq``: the round in which the pod's last accepted answer arrived (the worker seq number).
    ``verdict``: its troubleshooting class this round. ``evict``: the level it is leaving with.
    ``slow``: marked slow or hung; evicted at the next committed checkpoint.
    ``drain``: its node is being drained (planned maintenance); it leaves, without a fault
    counted, at the next committed checkpoint (or at the end of a check round, when training is
    stopped anyway), or when the drain's deadline passes.
    """

    inner_phase: Phase
    node: NodeName = NodeName("")
    pod_ip: str = ""
    finished: bool = False
    retries: int = 0
    last_failed_reason: str = ""
    updated_ts: float = 0.0
    seq: int = -1
    verdict: Classification | None = None
    evict: RecoveryLevel | None = None
    slow: bool = False
    drain: bool = False


@dataclass(frozen=True, slots=True)
class JobStatus:
    phase: Phase
    recover_count: int
    should_quit: bool
    seq: int
    pod_infos: immutables.Map[PodName, PodInfo]
    error_nodes: tuple[ErrorNode, ...] = ()
    outstanding: int = 0  # pods that have not yet finished the current round
    away: int = 0  # pods gone (awaiting replacement or not yet re-ACKed) outside Pending
    slow_count: int = 0  # pods marked slow
    drain_count: int = 0  # pods marked for a drain
    # The last counted fault, when it was an error at a known step: (step, what it said), and
    # how many incarnations in a row have ended with it (restart or stop).
    repeat_step: int = -1
    repeat_reason: str = ""
    repeat_count: int = 0


def pod_names(spec: JobSpec) -> tuple[PodName, ...]:
    """The stable pod names of a job: ``<job>-<rank>`` (a replacement keeps its name)."""
    return tuple(PodName(f"{spec.job}-{rank}") for rank in range(spec.worker_num))


def initial_status(
    spec: JobSpec,
    nodes: Sequence[NodeName] | None = None,
    *,
    now: float = 0.0,
    pod_ips: Sequence[str] | None = None,
) -> JobStatus:
    """Transition 1: a created job is Pending with every pod Pending (``pod_ips``: each pod's
    address where the platform knows it before the pod starts)."""
    if nodes is not None and len(nodes) != spec.worker_num:  # before a name is made (a log's
        raise ValueError(f"expected {spec.worker_num} nodes, got {len(nodes)}")  # word: 3e9)
    if pod_ips is not None and len(pod_ips) != spec.worker_num:
        raise ValueError(f"expected {spec.worker_num} pod addresses, got {len(pod_ips)}")
    names = pod_names(spec)
    placed: Iterable[NodeName] = nodes if nodes is not None else (NodeName("") for _ in names)
    ips: Iterable[str] = pod_ips if pod_ips is not None else ("" for _ in names)
    infos = immutables.Map(
        {
            name: PodInfo(inner_phase=Phase.PENDING, node=node, pod_ip=ip, updated_ts=now)
            for name, node, ip in zip(names, placed, ips, strict=True)
        }
    )
    return JobStatus(
        phase=Phase.PENDING,
        recover_count=0,
        should_quit=False,
        seq=0,
        pod_infos=infos,
        outstanding=len(names),
    )


def rank_of(pod: str) -> int:
    """The rank in a pod name ``<job>-<rank>`` (0 when there is none)."""
    tail = pod.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def pods_by_rank(status: JobStatus) -> list[tuple[PodName, PodInfo]]:
    return sorted(status.pod_infos.items(), key=lambda kv: rank_of(kv[0]))


def retries_of(status: JobStatus) -> tuple[int, ...]:
    """Retries in rank order, the seed's (1:0:0) notation."""
    return tuple(info.retries for _, info in pods_by_rank(status))
