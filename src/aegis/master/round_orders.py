"""A round's orders as the master publishes them: the core's ``SendOrder`` with its
environment fixed (where the round meets, the pods held hung, the straggler scores, the step to
resume from), kept in the job's record so a new leader can send them again (pure)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aegis.core import actions as act
from aegis.core import rendezvous
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Order, Phase
from aegis.core.stragglers import Straggler
from aegis.wire import messages as m

ROUND_ORDERS = (Order.RUN, Order.RESTART, Order.BOOTCHECK, Order.TROUBLESHOOT)
TRAINING_ORDERS = (Order.RUN, Order.RESTART)


@dataclass(frozen=True, slots=True)
class RoundOrder:
    """An order as published (env materialised), kept in the job's record (``job_record``)
    for re-sending."""

    order: Order
    phase: Phase
    seq: int
    pods: tuple[str, ...] = ()
    exit_code: int = 0
    env: dict[str, str] = field(default_factory=dict)


def round_env(
    order: act.SendOrder,
    spec: JobSpec,
    status: JobStatus,
    rule: rendezvous.RendezvousRule,
    free_port: Callable[[], int],
    *,
    scores: Mapping[str, float],
    resume: int | None,
) -> dict[str, str]:
    """The environment of ``order``: a round of training or checks meets where rank 0's pod is
    now, on a fresh port every round (an incarnation, or a check group, never reuses the
    TCPStore/gloo addresses of an earlier one); a troubleshooting round names the pods held
    hung (only their hang check fails) and the straggler the training named, with its score
    (allreduce_perf's tie-breaker, :func:`tie_scores`); a training round resumes from
    ``resume``, the step every pod committed."""
    if order.order not in ROUND_ORDERS:
        return {}
    key = "MASTER_PORT" if order.order in TRAINING_ORDERS else "CHECK_MASTER_PORT"
    meet = rendezvous.endpoint(rule, spec, status, order.seq, free_port)
    env = {"MASTER_ADDR": meet.host, key: str(meet.port)}
    if order.order is Order.TROUBLESHOOT:
        env[m.HUNG_PODS_ENV] = ",".join(
            sorted(pod for pod, info in status.pod_infos.items() if info.slow)
        )
        if scores:
            env[m.STRAGGLER_SCORES_ENV] = scores_env(scores)
    if key == "MASTER_PORT" and resume is not None:
        env[m.RESUME_STEP_ENV] = str(resume)
    return env


def tie_scores(
    order: Order, before: Phase, slowdown: bool, named: Straggler | None
) -> dict[str, float]:
    """The straggler scores a round's order carries for allreduce_perf's tie-breaker: only in
    the troubleshooting round a slowdown starts (``slowdown``: the pace watch's report stopped
    training, ``before`` RunCommand; a fault's round looks for the fault, and after an eviction
    or a restart the scores describe a round that was already disturbed), and only the pod the
    robust rule named (late in most windows, and alone), never a raw score."""
    if order is not Order.TROUBLESHOOT or before is not Phase.RUN_COMMAND or not slowdown:
        return {}
    if named is None:
        return {}
    return {named.pod: named.score} if named.score > 0 else {}


def scores_env(scores: Mapping[str, float]) -> str:
    """``pod=score,...`` for a troubleshooting order (``m.STRAGGLER_SCORES_ENV``)."""
    return ",".join(f"{pod}={score:.3f}" for pod, score in sorted(scores.items()))
