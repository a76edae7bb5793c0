"""The job state machine: ``step(spec, status, event, now) -> (status, actions)``.

Pure: no I/O, no clock, no logging. Every rule of DESIGN section 3 lives here, one small function
per decision so that a transition reads like a table row (and so that the model checker's mutants
can replace exactly one rule). An event that changes nothing returns the same status object and
one ``Rejected`` action saying why.

Cost: an ordinary event (ACK, one pod's answer) touches one pod in the persistent map and the
round counters: O(log pods). Only a phase change walks the pods, once per round.
"""

from __future__ import annotations

from typing import assert_never

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import updates
from aegis.core.model import ErrorNode, JobSpec, JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import CHECK_PHASES, TERMINAL_PHASES, Order, Phase
from aegis.core.recovery import (
    CONTAINER_RESTART_EXIT_CODE,
    JOB_FAILED_EXIT_CODE,
    LEVEL_BY_CLASS,
    NODE_BAD_EXIT_CODE,
    SOFTWARE_FAULT_CLASSES,
    Classification,
    RecoveryLevel,
)

Result = tuple[JobStatus, tuple[act.Action, ...]]
PodMap = updates.PodMap


def step(spec: JobSpec, status: JobStatus, event: ev.Event, now: float) -> Result:
    """Feed one event to the job; return the new status and what the shells must do."""
    if status.phase in TERMINAL_PHASES:
        return _reject(status, act.RejectReason.TERMINAL, status.phase)
    match event:
        case ev.QuitRequested(reason=reason):
            return _fail(spec, status, reason, now, budget_spent=False)
        case ev.CheckpointCommitted():
            return _on_checkpoint(status, now)
        case ev.DrainRequested(pods=pods, reason=reason):
            return _on_drain(status, pods, reason, now)
        case ev.DrainForced(pods=pods, reason=reason):
            return _on_drain_forced(status, pods, reason, now)
        case ev.SlowdownReported():
            return _on_slowdown(status, now)
        case ev.PodAcked(pod=pod, pod_ip=ip):
            info = status.pod_infos.get(pod)
            if info is None:
                return _reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return _addressed(pod, ip, status, _on_ack(spec, status, pod, info, now))
        case ev.HeartbeatLost(pod=pod):
            info = status.pod_infos.get(pod)
            if info is None:
                return _reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return _on_lost(spec, status, pod, info, now)
        case ev.PodRestarted(pod=pod):
            info = status.pod_infos.get(pod)
            if info is None:
                return _reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return _on_restarted(spec, status, event, info, now)
        case ev.ChecksReported() | ev.PodFinished() | ev.PodErrored() | ev.HangReported():
            return _on_round_message(spec, status, event, now)
        case _:
            assert_never(event)


# ---------------------------------------------------------------------------------------------
# Round messages: answers to the current round, stale or duplicate ones rejected.


def _on_round_message(spec: JobSpec, status: JobStatus, msg: ev.RoundMessage, now: float) -> Result:
    info = status.pod_infos.get(msg.pod)
    if info is None:
        return _reject(status, act.RejectReason.UNKNOWN_POD, msg.pod)
    if not _is_current(status, msg.phase, msg.seq):
        return _reject(status, act.RejectReason.STALE, f"{msg.phase}/{msg.seq}")
    if info.inner_phase != status.phase:
        return _reject(status, act.RejectReason.STALE, f"pod is {info.inner_phase}")
    if _already_finished(info):
        return _reject(status, act.RejectReason.DUPLICATE, f"{msg.pod} seq {msg.seq}")
    phase = status.phase
    match msg:
        case ev.ChecksReported(verdict=verdict, reason=reason) if phase in CHECK_PHASES:
            return _record_answer(spec, status, msg.pod, info, verdict, reason, now)
        case ev.PodErrored(reason=reason) if phase in CHECK_PHASES:
            # An error while checking: the pod is marked for exit (seed 7.2 step 3).
            verdict = Classification.HARDWARE
            return _record_answer(spec, status, msg.pod, info, verdict, reason, now)
        case ev.PodFinished(exit_code=0) if phase is Phase.RUN_COMMAND:
            return _on_success(status, msg.pod, info, now)
        case ev.PodFinished(exit_code=code) if phase is Phase.RUN_COMMAND:
            return _count_fault(spec, status, msg.pod, f"exit code {code}", now, leaving=None)
        case ev.PodErrored(reason=reason, fault_class=cls, step=step) if phase is Phase.RUN_COMMAND:
            checks = _needs_checks(spec, cls)
            key = None if step is None else (step, reason)
            return _count_fault(
                spec, status, msg.pod, reason, now, leaving=None, checks=checks, repeat=key
            )
        case ev.HangReported(reason=reason, blame=blame) if phase is Phase.RUN_COMMAND:
            marked = _mark_slow(status, msg.pod, info) if blame else status
            return _count_fault(spec, marked, msg.pod, reason, now, leaving=None)
        case _:
            return _reject(status, act.RejectReason.WRONG_PHASE, f"{type(msg).__name__} in {phase}")


def _is_current(status: JobStatus, phase: Phase, seq: int) -> bool:
    """A message answers the current round only if both its phase and its seq match."""
    return seq == status.seq and phase == status.phase


def _already_finished(info: PodInfo) -> bool:
    """The same answer is never processed twice (NoFinishDoubleProcessed)."""
    return info.finished


def _record_answer(
    spec: JobSpec,
    status: JobStatus,
    pod: PodName,
    info: PodInfo,
    verdict: Classification,
    reason: str,
    now: float,
) -> Result:
    failed_reason = reason if verdict is not Classification.HEALTHY else info.last_failed_reason
    new_info = updates.pod(
        info, finished=True, seq=status.seq, verdict=verdict, reason=failed_reason, ts=now
    )
    status = updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, new_info),
        outstanding=status.outstanding - 1,
    )
    if status.outstanding > 0:
        return status, ()
    if status.phase is Phase.BOOT_CHECKING:
        return _resolve_bootcheck(spec, status, now)
    return _resolve_troubleshooting(spec, status, now)


def _on_success(status: JobStatus, pod: PodName, info: PodInfo, now: float) -> Result:
    new_info = updates.pod(info, finished=True, seq=status.seq, ts=now)
    status = updates.status(
        status, pod_infos=status.pod_infos.set(pod, new_info), outstanding=status.outstanding - 1
    )
    if status.outstanding > 0:
        return status, ()
    return _end(status, Phase.SUCCEED, "every pod finished with exit code 0", now)


# ---------------------------------------------------------------------------------------------
# Faults in RunCommand: the only place where fault budget is spent.


def _count_fault(
    spec: JobSpec,
    status: JobStatus,
    pod: PodName,
    reason: str,
    now: float,
    *,
    leaving: Phase | None,
    checks: bool = True,
    repeat: tuple[int, str] | None = None,
) -> Result:
    """Transition 5: one fault of ``pod`` in RunCommand. ``leaving``: the pod's inner phase when
    it is gone (Restarting: awaiting a replacement; Pending: restarted, must ACK again).
    ``checks``: whether a present pod's fault needs a troubleshooting round (a software fault
    does not: every pod restarts in place at once). ``repeat``: (step, what it said) of an
    error at a known step: the same one ``spec.repeat_limit`` times in a row stops the job."""
    info = status.pod_infos[pod]
    count = 0
    if repeat is not None:
        same = (status.repeat_step, status.repeat_reason) == repeat
        count = status.repeat_count + 1 if same else 1
    verdict = ""
    spent = info.retries + 1 > spec.max_retry or _budget_exhausted(spec, status)
    if repeat is not None and spec.repeat_limit and count >= spec.repeat_limit and not spent:
        verdict = (f"the same fault {count} times in a row at step {repeat[0]} "
                   f"({repeat[1]}): a restart does not fix it; stopping")  # fmt: skip
    counted = updates.pod(info, retries=info.retries + 1, reason=verdict or reason, ts=now)
    status = updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, counted),
        recover_count=_capped_recover_count(spec, status),
        repeat_step=repeat[0] if repeat is not None else -1,
        repeat_reason=repeat[1] if repeat is not None else "",
        repeat_count=count,
    )
    record = act.RecordFault(pod=pod, reason=reason, counted=True)
    if verdict:  # (a budget spent by this very fault says so first, below)
        new_status, actions = _fail(spec, status, verdict, now, budget_spent=False)
        return new_status, (record, *actions)
    if leaving is None and not checks:
        new_status, actions = _restart_in_place(spec, status, now)
        return new_status, (record, *actions)
    if leaving is None:
        new_status, orders = _start_round(status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now)
        return new_status, (record, *orders)
    new_status = _enter_restarting(status, {pod: leaving}, now)
    stop = act.SendOrder(Order.STOP, Phase.RESTARTING, new_status.seq)
    replace: tuple[act.Action, ...] = ()
    if leaving is Phase.RESTARTING:
        replace = (act.ReplacePod(pod=pod, reason=reason),)
    return new_status, (record, stop, *replace)


def _needs_checks(spec: JobSpec, fault_class: str) -> bool:
    """Only a fault the log names as software (a plain Python exception) skips the checks."""
    return not (spec.software_restart and fault_class in SOFTWARE_FAULT_CLASSES)


def _restart_in_place(spec: JobSpec, status: JobStatus, now: float) -> Result:
    """Level 1 without a round: the budget decides as at the end of a troubleshooting round.
    Training has stopped anyway, so pods of a drained node leave now (as when a round ends)."""
    if _budget_exhausted(spec, status):
        return _fail(spec, status, "fault budget exhausted", now, budget_spent=True)
    if status.drain_count > 0:
        draining = {pod: RecoveryLevel.DRAIN for pod, i in status.pod_infos.items() if i.drain}
        return _evict_running(status, draining, now)
    status = updates.status(status, pod_infos=_align_retries(status))
    return _start_round(status, Phase.RUN_COMMAND, Order.RESTART, now)


def _capped_recover_count(spec: JobSpec, status: JobStatus) -> int:
    """recover_count = min(recover_count + 1, max_retry): the cap TLC found missing in the seed."""
    return min(status.recover_count + 1, spec.max_retry)


def _mark_slow(status: JobStatus, pod: PodName, info: PodInfo) -> JobStatus:
    if info.slow:
        return status
    return updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, updates.pod(info, slow=True)),
        slow_count=status.slow_count + 1,
    )


# ---------------------------------------------------------------------------------------------
# Resolving a round of checks.


def _resolve_bootcheck(spec: JobSpec, status: JobStatus, now: float) -> Result:
    """Transition 3: all PASS -> RunCommand; a failing pod exits (not counted) and is replaced,
    after which a fresh bootcheck round runs for everybody."""
    leaving = {
        pod: _bootcheck_level(info.verdict)
        for pod, info in status.pod_infos.items()
        if info.verdict is not Classification.HEALTHY
    }
    for pod, info in status.pod_infos.items():
        if info.drain:
            leaving[pod] = _drain_level(leaving.get(pod, RecoveryLevel.IN_PLACE))
    if not leaving:
        return _start_round(status, Phase.RUN_COMMAND, Order.RUN, now)
    return _evict(status, leaving, now, phase=Phase.BOOT_CHECKING)


def _bootcheck_level(verdict: Classification | None) -> RecoveryLevel:
    # Before training nothing is lost by moving: a slow node leaves at once.
    if verdict is Classification.RUNTIME:
        return RecoveryLevel.CONTAINER
    return RecoveryLevel.NODE


def _drain_level(level: RecoveryLevel) -> RecoveryLevel:
    """A draining pod leaves its node in any case; only a bad node (level 3) says more."""
    return level if level is RecoveryLevel.NODE else RecoveryLevel.DRAIN


def _resolve_troubleshooting(spec: JobSpec, status: JobStatus, now: float) -> Result:
    """Transition 8: budget exhausted -> Failed; a pod must exit -> Restarting; else restart
    every pod in place (RunCommand) with retries aligned to recover_count."""
    if _budget_exhausted(spec, status):
        return _fail(spec, status, "fault budget exhausted", now, budget_spent=True)
    leaving: dict[PodName, RecoveryLevel] = {}
    for pod, info in status.pod_infos.items():
        if info.verdict is None:
            continue
        level = LEVEL_BY_CLASS[info.verdict]
        if info.drain:  # training is stopped: nothing is lost by leaving now
            leaving[pod] = _drain_level(level)
        elif level is RecoveryLevel.EVICT_SLOW:
            status = _mark_slow(status, pod, info)
        elif level is not RecoveryLevel.IN_PLACE:
            leaving[pod] = level
    if leaving:
        return _evict(status, leaving, now, phase=Phase.RESTARTING)
    status = updates.status(status, pod_infos=_align_retries(status))
    return _start_round(status, Phase.RUN_COMMAND, Order.RESTART, now)


def _budget_exhausted(spec: JobSpec, status: JobStatus) -> bool:
    return any(info.retries > spec.max_retry for info in status.pod_infos.values())


def _align_retries(status: JobStatus) -> PodMap:
    """Back to RunCommand: every pod's retries = recover_count (one down, all down)."""
    rc = status.recover_count
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if info.retries != rc:
                pods[pod] = updates.pod(info, retries=rc)
        aligned = pods.finish()
    return aligned


def _evict(
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
            error_nodes = _add_error_node(error_nodes, info.node, reason, now)
            actions.append(act.BlacklistNode(node=info.node, reason=reason))
    status = updates.status(status, error_nodes=error_nodes)
    if phase is Phase.RESTARTING:
        return _enter_restarting(status, dict.fromkeys(leaving, Phase.RESTARTING), now), tuple(
            actions
        )
    with status.pod_infos.mutate() as pods:
        for pod, level in leaving.items():
            pods[pod] = updates.pod(
                pods[pod], inner=Phase.RESTARTING, finished=False, evict=level, ts=now
            )
        pod_infos = pods.finish()
    status = updates.status(
        status,
        pod_infos=pod_infos,
        outstanding=status.outstanding + len(leaving),
        away=status.away + len(leaving),
    )
    return status, tuple(actions)


def _add_error_node(
    nodes: tuple[ErrorNode, ...], node: NodeName, reason: str, now: float
) -> tuple[ErrorNode, ...]:
    if any(entry.node == node for entry in nodes):
        return nodes
    return (*nodes, ErrorNode(node=node, reason=reason, ts=now))


# ---------------------------------------------------------------------------------------------
# Membership: ACKs, lost pods, restarted pods.


def _addressed(pod: PodName, ip: str | None, before: JobStatus, result: Result) -> Result:
    """An accepted ACK that says where the pod is: its ``pod_ip`` from now on (the newest word:
    a hand-started agent's is the only one; a platform's agrees with it)."""
    status, actions = result
    info = status.pod_infos.get(pod)
    if not ip or status is before or info is None or info.pod_ip == ip:
        return result
    return updates.status(
        status, pod_infos=status.pod_infos.set(pod, updates.pod(info, pod_ip=ip))
    ), actions


def _on_ack(spec: JobSpec, status: JobStatus, pod: PodName, info: PodInfo, now: float) -> Result:
    if status.phase is Phase.PENDING:
        if info.finished:
            return _reject(status, act.RejectReason.DUPLICATE, f"{pod} already ACKed")
        if info.inner_phase is not Phase.PENDING:
            return _reject(status, act.RejectReason.STALE, f"{pod} is awaiting a replacement")
        status = updates.status(
            status,
            pod_infos=status.pod_infos.set(pod, updates.pod(info, finished=True, ts=now)),
            outstanding=status.outstanding - 1,
        )
        if status.outstanding > 0:
            return status, ()
        return _start_round(status, Phase.BOOT_CHECKING, Order.BOOTCHECK, now)
    # The PENDING exception: an ACK carries no round; it is accepted from a pod that (re)joined.
    if info.inner_phase is not Phase.PENDING:
        return _reject(status, act.RejectReason.DUPLICATE, f"{pod} already ACKed")
    if status.phase is Phase.RESTARTING:
        back = updates.pod(info, inner=Phase.RESTARTING, finished=True, evict=None, ts=now)
        status = updates.status(
            status,
            pod_infos=status.pod_infos.set(pod, back),
            outstanding=status.outstanding - 1,
            away=status.away - 1,
        )
        if status.away > 0:
            return status, ()
        return _start_round(status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now)
    if status.phase in CHECK_PHASES:
        back = updates.pod(info, inner=status.phase, evict=None, ts=now)
        status = updates.status(
            status, pod_infos=status.pod_infos.set(pod, back), away=status.away - 1
        )
        if status.away > 0:
            return status, ()
        order = Order.BOOTCHECK if status.phase is Phase.BOOT_CHECKING else Order.TROUBLESHOOT
        return _start_round(status, status.phase, order, now)
    return _reject(status, act.RejectReason.WRONG_PHASE, f"ACK in {status.phase}")


def _on_lost(spec: JobSpec, status: JobStatus, pod: PodName, info: PodInfo, now: float) -> Result:
    reason = "heartbeat lost"
    if _awaiting_replacement(info):
        return _reject(status, act.RejectReason.IGNORED, f"{pod} is already being replaced")
    replace = act.ReplacePod(pod=pod, reason=reason)
    if status.phase is Phase.RUN_COMMAND:
        return _count_fault(spec, status, pod, reason, now, leaving=Phase.RESTARTING)
    status = _leave(status, pod, info, Phase.RESTARTING, reason, now)
    return status, (act.RecordFault(pod=pod, reason=reason, counted=False), replace)


def _on_restarted(
    spec: JobSpec, status: JobStatus, event: ev.PodRestarted, info: PodInfo, now: float
) -> Result:
    pod = event.pod
    moved = event.node is not None and event.node != info.node
    placed = updates.pod(
        info,
        node=event.node if event.node is not None else info.node,
        pod_ip=event.pod_ip if event.pod_ip is not None else info.pod_ip,
        ts=now,
        drain=False if moved else None,
    )
    if moved and info.drain:  # the drain mark belongs to the node it left
        status = updates.status(status, drain_count=status.drain_count - 1)
    if _awaiting_replacement(info):
        # The replacement the platform was asked for: it must ACK before it counts as back.
        return updates.status(
            status, pod_infos=status.pod_infos.set(pod, updates.pod(placed, inner=Phase.PENDING))
        ), ()
    reason = "pod restarted"
    status = updates.status(status, pod_infos=status.pod_infos.set(pod, placed))
    if status.phase is Phase.RUN_COMMAND:
        return _count_fault(spec, status, pod, reason, now, leaving=Phase.PENDING)
    # Outside RunCommand nothing is counted and only this pod is reset (seed branch 4).
    status = _leave(status, pod, placed, Phase.PENDING, reason, now)
    return status, (act.RecordFault(pod=pod, reason=reason, counted=False),)


def _awaiting_replacement(info: PodInfo) -> bool:
    return info.inner_phase is Phase.RESTARTING and not info.finished


def _leave(
    status: JobStatus, pod: PodName, info: PodInfo, inner: Phase, reason: str, now: float
) -> JobStatus:
    """Outside RunCommand a pod goes away (lost or restarted) without a fault being counted."""
    if status.phase is Phase.PENDING:
        # Before bootcheck a pod only has to (re)ACK (once replaced, when it was lost).
        left = updates.pod(info, inner=inner, finished=False, reason=reason, ts=now)
        outstanding = status.outstanding + (1 if info.finished else 0)
        return updates.status(
            status, pod_infos=status.pod_infos.set(pod, left), outstanding=outstanding
        )
    was_away = info.inner_phase in (Phase.PENDING, Phase.RESTARTING) and not info.finished
    left = updates.pod(info, inner=inner, finished=False, verdict=None, reason=reason, ts=now)
    return updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, left),
        outstanding=status.outstanding + (1 if info.finished else 0),
        away=status.away + (0 if was_away else 1),
    )


# ---------------------------------------------------------------------------------------------
# Safe point, terminal phases, rounds.


def _on_checkpoint(status: JobStatus, now: float) -> Result:
    """At a committed checkpoint, pods marked slow (or hung) are evicted and blacklisted, and
    pods of a drained node leave (no fault, no blacklist)."""
    if status.phase is not Phase.RUN_COMMAND or status.slow_count + status.drain_count == 0:
        return _reject(status, act.RejectReason.IGNORED, "no pod to evict at this checkpoint")
    leaving: dict[PodName, RecoveryLevel] = {}
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if info.drain:
                leaving[pod] = RecoveryLevel.DRAIN
            elif info.slow:
                leaving[pod] = RecoveryLevel.EVICT_SLOW
                pods[pod] = updates.pod(info, reason=info.last_failed_reason or "slow")
        status = updates.status(status, pod_infos=pods.finish())
    return _evict_running(status, leaving, now)


def _on_slowdown(status: JobStatus, now: float) -> Result:
    """Training slowed down: stop it and run the checks, nothing counted. A pod they find slow
    is marked and leaves at the next committed checkpoint; if none is, training restarts in
    place. While a pod waits to leave at a checkpoint (slow, or drained: ranks may hold after
    saving), or once a pod has finished (the job is ending), a slowdown is expected: ignored."""
    if status.phase is not Phase.RUN_COMMAND:
        return _reject(status, act.RejectReason.IGNORED, f"slowdown in {status.phase}")
    if status.outstanding < len(status.pod_infos):
        return _reject(status, act.RejectReason.IGNORED, "pods have finished: the job is ending")
    if status.slow_count + status.drain_count > 0:
        return _reject(status, act.RejectReason.IGNORED, "a pod leaves at the next checkpoint")
    return _start_round(status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now)


def _evict_running(status: JobStatus, leaving: dict[PodName, RecoveryLevel], now: float) -> Result:
    """Pods leave a running job: every pod stops training, the job waits in Restarting."""
    evicted, actions = _evict(status, leaving, now, phase=Phase.RESTARTING)
    stop = act.SendOrder(Order.STOP, Phase.RESTARTING, evicted.seq)
    return evicted, (stop, *actions)


def _on_drain(status: JobStatus, pods: tuple[PodName, ...], reason: str, now: float) -> Result:
    """Mark the pods of a drained node. In RunCommand they leave at the next committed
    checkpoint (the shell asks for one); in any other phase training is stopped, so they leave
    when the current round resolves. Nothing is counted."""
    marked = [
        pod
        for pod in dict.fromkeys(pods)
        if (info := status.pod_infos.get(pod)) is not None
        and not info.drain
        and not _awaiting_replacement(info)
    ]
    if not marked:
        return _reject(status, act.RejectReason.IGNORED, "no pod left to drain")
    with status.pod_infos.mutate() as infos:
        for pod in marked:
            infos[pod] = updates.pod(infos[pod], drain=True, reason=f"drain: {reason}", ts=now)
        pod_infos = infos.finish()
    status = updates.status(
        status, pod_infos=pod_infos, drain_count=status.drain_count + len(marked)
    )
    return status, ()


def _on_drain_forced(
    status: JobStatus, pods: tuple[PodName, ...], reason: str, now: float
) -> Result:
    """The drain stops waiting for a checkpoint: its pods leave now (from RunCommand only;
    elsewhere they leave when the round resolves anyway)."""
    if status.phase is not Phase.RUN_COMMAND:
        return _reject(
            status, act.RejectReason.IGNORED, f"drain waits for the {status.phase} round"
        )
    leaving = {
        pod: RecoveryLevel.DRAIN
        for pod in dict.fromkeys(pods)
        if (info := status.pod_infos.get(pod)) is not None and info.drain
    }
    if not leaving:
        return _reject(status, act.RejectReason.IGNORED, "no draining pod")
    with status.pod_infos.mutate() as infos:
        for pod in leaving:
            info = infos[pod]
            infos[pod] = updates.pod(info, reason=f"{info.last_failed_reason} ({reason})")
        status = updates.status(status, pod_infos=infos.finish())
    return _evict_running(status, leaving, now)


def _fail(
    spec: JobSpec, status: JobStatus, reason: str, now: float, *, budget_spent: bool
) -> Result:
    """Transitions 8 (budget exhausted) and 9 (should_quit from outside)."""
    rc = spec.max_retry + 1 if budget_spent else status.recover_count
    status = updates.status(status, recover_count=rc, should_quit=True)
    return _end(status, Phase.FAILED, reason, now)


def _end(status: JobStatus, phase: Phase, reason: str, now: float) -> Result:
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            pods[pod] = updates.pod(info, inner=phase, finished=True, ts=now)
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


def _start_round(
    status: JobStatus, phase: Phase, order: Order, now: float
) -> tuple[JobStatus, tuple[act.Action, ...]]:
    """A new round: bump seq, every pod enters ``phase`` unfinished, one order to all."""
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            pods[pod] = updates.pod(
                info, inner=phase, finished=False, verdict=None, evict=None, ts=now
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


def _enter_restarting(status: JobStatus, leaving: dict[PodName, Phase], now: float) -> JobStatus:
    """Restarting: the leaving pods are away, the others present (finished) and idle."""
    with status.pod_infos.mutate() as pods:
        for pod, info in status.pod_infos.items():
            if pod in leaving:
                pods[pod] = updates.pod(
                    info, inner=leaving[pod], finished=False, verdict=None, ts=now
                )
            else:
                pods[pod] = updates.pod(
                    info, inner=Phase.RESTARTING, finished=True, verdict=None, ts=now
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


def _reject(status: JobStatus, reason: act.RejectReason, detail: str = "") -> Result:
    return status, (act.Rejected(reason=reason, detail=detail),)
