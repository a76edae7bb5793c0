"""The job state machine: ``step(spec, status, event, now) -> (status, actions)``.

Pure: no I/O, no clock, no logging. Every rule of DESIGN section 3 lives in this package, one
small function per decision so that a transition reads like a table row (and so that the model
checker's mutants can replace exactly one rule). An event that changes nothing returns the same
status object and one ``Rejected`` action saying why. This module dispatches the events and
holds the rules of round messages, faults and membership; ``rounds`` holds how a round starts,
ends and makes pods leave, ``resolution`` how a round of checks resolves, and ``departures``
the pods that leave at a safe point (slow marks, drains).

Cost: an ordinary event (ACK, one pod's answer) touches one pod in the persistent map and the
round counters: O(log pods). Only a phase change walks the pods, once per round.
"""

from __future__ import annotations

from typing import assert_never

from aegis.core import actions as act
from aegis.core import departures, recovery, resolution, rounds, updates
from aegis.core import events as ev
from aegis.core.model import JobSpec, JobStatus, PodInfo, PodName
from aegis.core.phases import CHECK_PHASES, TERMINAL_PHASES, Order, Phase
from aegis.core.recovery import (
    SOFTWARE_FAULT_CLASSES,
    Classification,
    RecoveryLevel,
)

Result = rounds.Result
PodMap = rounds.PodMap


def step(spec: JobSpec, status: JobStatus, event: ev.Event, now: float) -> Result:  # noqa: PLR0912 (the dispatch: one case per event type)
    """Feed one event to the job; return the new status and what the shells must do."""
    if status.phase in TERMINAL_PHASES:
        return rounds.reject(status, act.RejectReason.TERMINAL, status.phase)
    match event:
        case ev.QuitRequested(reason=reason):
            return rounds.fail(spec, status, reason, now, budget_spent=False)
        case ev.CheckpointCommitted():
            return departures.on_checkpoint(status, now)
        case ev.DrainRequested(pods=pods, reason=reason):
            return departures.on_drain(status, pods, reason, now)
        case ev.DrainForced(pods=pods, reason=reason):
            return departures.on_drain_forced(status, pods, reason, now)
        case ev.SlowdownReported():
            return _on_slowdown(status, now)
        case ev.PodAcked(pod=pod, pod_ip=ip):
            info = status.pod_infos.get(pod)
            if info is None:
                return rounds.reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return _addressed(pod, ip, status, _on_ack(spec, status, pod, info, now))
        case ev.HeartbeatLost(pod=pod):
            info = status.pod_infos.get(pod)
            if info is None:
                return rounds.reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return _on_lost(spec, status, pod, info, now)
        case ev.JoinTimedOut(pod=pod, reason=reason):
            info = status.pod_infos.get(pod)
            if info is None:
                return rounds.reject(status, act.RejectReason.UNKNOWN_POD, pod)
            return rounds.replace_elsewhere(status, pod, info, reason, now)
        case ev.NodeDown(node=node, reason=reason):
            return rounds.node_down(status, node, reason, now)
        case ev.PodRestarted(pod=pod):
            info = status.pod_infos.get(pod)
            if info is None:
                return rounds.reject(status, act.RejectReason.UNKNOWN_POD, pod)
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
        return rounds.reject(status, act.RejectReason.UNKNOWN_POD, msg.pod)
    if not _is_current(status, msg.phase, msg.seq):
        return rounds.reject(status, act.RejectReason.STALE, f"{msg.phase}/{msg.seq}")
    if info.inner_phase != status.phase:
        return rounds.reject(status, act.RejectReason.STALE, f"pod is {info.inner_phase}")
    if _already_finished(info):
        return rounds.reject(status, act.RejectReason.DUPLICATE, f"{msg.pod} seq {msg.seq}")
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
            last = (status.repeat_step, status.repeat_reason, status.repeat_count)
            run = recovery.run_after(last, step, reason, cls)
            return _count_fault(
                spec, status, msg.pod, reason, now, leaving=None, checks=checks, repeat=run
            )
        case ev.HangReported(reason=reason, blame=blame) if phase is Phase.RUN_COMMAND:
            marked = rounds.mark_slow(status, msg.pod, info) if blame else status
            return _count_fault(spec, marked, msg.pod, reason, now, leaving=None)
        case _:
            return rounds.reject(
                status, act.RejectReason.WRONG_PHASE, f"{type(msg).__name__} in {phase}"
            )


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
        info,
        finished=True,
        seq=status.seq,
        verdict=verdict,
        last_failed_reason=failed_reason,
        updated_ts=now,
    )
    status = updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, new_info),
        outstanding=status.outstanding - 1,
    )
    if status.outstanding > 0 and not resolution.concludes_early(status, info, verdict):
        return status, ()
    if status.phase is Phase.BOOT_CHECKING:
        return resolution.resolve_bootcheck(spec, status, now)
    return resolution.resolve_troubleshooting(spec, status, now)


def _on_success(status: JobStatus, pod: PodName, info: PodInfo, now: float) -> Result:
    new_info = updates.pod(info, finished=True, seq=status.seq, updated_ts=now)
    status = updates.status(
        status, pod_infos=status.pod_infos.set(pod, new_info), outstanding=status.outstanding - 1
    )
    if status.outstanding > 0:
        return status, ()
    return rounds.end(status, Phase.SUCCEED, "every pod finished with exit code 0", now)


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
    repeat: recovery.Run = recovery.NO_RUN,
) -> Result:
    """Transition 5: one fault of ``pod`` in RunCommand. ``leaving``: the pod's inner phase when
    it is gone (Restarting: awaiting a replacement; Pending: restarted, must ACK again).
    ``checks``: whether a present pod's fault needs a troubleshooting round (a software fault
    does not: every pod restarts in place at once). ``repeat``: the run of the same error at
    the same step that this fault makes (``recovery.run_after``; none for a fault of another
    kind): ``spec.repeat_limit`` in a row stops the job."""
    info = status.pod_infos[pod]
    at, said, count = repeat
    verdict = ""
    spent = info.retries + 1 > spec.max_retry or rounds.budget_exhausted(spec, status)
    if spec.repeat_limit and count >= spec.repeat_limit and not spent:
        verdict = (f"the same fault {count} times in a row at step {at} "
                   f"({said or reason}): a restart does not fix it; stopping")  # fmt: skip
    counted = updates.pod(
        info, retries=info.retries + 1, last_failed_reason=verdict or reason, updated_ts=now
    )
    status = updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, counted),
        recover_count=_capped_recover_count(spec, status),
        repeat_step=at,
        repeat_reason=said,
        repeat_count=count,
    )
    record = act.RecordFault(pod=pod, reason=reason, counted=True)
    if verdict:  # (a budget spent by this very fault says so first, below)
        new_status, actions = rounds.fail(spec, status, verdict, now, budget_spent=False)
        return new_status, (record, *actions)
    if leaving is None and not checks:
        new_status, actions = _restart_in_place(spec, status, now)
        return new_status, (record, *actions)
    if leaving is None:
        new_status, orders = rounds.start_round(
            status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now
        )
        return new_status, (record, *orders)
    new_status = rounds.enter_restarting(status, {pod: leaving}, now)
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
    if rounds.budget_exhausted(spec, status):
        return rounds.fail(spec, status, "fault budget exhausted", now, budget_spent=True)
    if status.drain_count > 0:
        draining = {pod: RecoveryLevel.DRAIN for pod, i in status.pod_infos.items() if i.drain}
        return rounds.evict_running(status, draining, now)
    status = updates.status(status, pod_infos=rounds.align_retries(status))
    return rounds.start_round(status, Phase.RUN_COMMAND, Order.RESTART, now)


def _capped_recover_count(spec: JobSpec, status: JobStatus) -> int:
    """recover_count = min(recover_count + 1, max_retry): the cap TLC found missing in the seed."""
    return min(status.recover_count + 1, spec.max_retry)


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
            return rounds.reject(status, act.RejectReason.DUPLICATE, f"{pod} already ACKed")
        if info.inner_phase is not Phase.PENDING:
            return rounds.reject(status, act.RejectReason.STALE, f"{pod} is awaiting a replacement")
        status = updates.status(
            status,
            pod_infos=status.pod_infos.set(pod, updates.pod(info, finished=True, updated_ts=now)),
            outstanding=status.outstanding - 1,
        )
        if status.outstanding > 0:
            return status, ()
        return rounds.start_round(status, Phase.BOOT_CHECKING, Order.BOOTCHECK, now)
    # The PENDING exception: an ACK carries no round; it is accepted from a pod that (re)joined.
    if info.inner_phase is not Phase.PENDING:
        return rounds.reject(status, act.RejectReason.DUPLICATE, f"{pod} already ACKed")
    if status.phase is Phase.RESTARTING:
        back = updates.pod(
            info, inner_phase=Phase.RESTARTING, finished=True, evict=None, updated_ts=now
        )
        status = updates.status(
            status,
            pod_infos=status.pod_infos.set(pod, back),
            outstanding=status.outstanding - 1,
            away=status.away - 1,
        )
        if status.away > 0:
            return status, ()
        return rounds.start_round(status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now)
    if status.phase in CHECK_PHASES:
        back = updates.pod(info, inner_phase=status.phase, evict=None, updated_ts=now)
        status = updates.status(
            status, pod_infos=status.pod_infos.set(pod, back), away=status.away - 1
        )
        if status.away > 0:
            return status, ()
        order = Order.BOOTCHECK if status.phase is Phase.BOOT_CHECKING else Order.TROUBLESHOOT
        return rounds.start_round(status, status.phase, order, now)
    return rounds.reject(status, act.RejectReason.WRONG_PHASE, f"ACK in {status.phase}")


def _on_lost(spec: JobSpec, status: JobStatus, pod: PodName, info: PodInfo, now: float) -> Result:
    reason = "heartbeat lost"
    if rounds.awaiting_replacement(info):
        return rounds.reject(status, act.RejectReason.IGNORED, f"{pod} is already being replaced")
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
        updated_ts=now,
        drain=info.drain and not moved,
    )
    if moved and info.drain:  # the drain mark belongs to the node it left
        status = updates.status(status, drain_count=status.drain_count - 1)
    if rounds.awaiting_replacement(info):
        # The replacement the platform was asked for: it must ACK before it counts as back.
        return updates.status(
            status,
            pod_infos=status.pod_infos.set(pod, updates.pod(placed, inner_phase=Phase.PENDING)),
        ), ()
    reason = "pod restarted"
    status = updates.status(status, pod_infos=status.pod_infos.set(pod, placed))
    if status.phase is Phase.RUN_COMMAND:
        return _count_fault(spec, status, pod, reason, now, leaving=Phase.PENDING)
    # Outside RunCommand nothing is counted and only this pod is reset (seed branch 4).
    status = _leave(status, pod, placed, Phase.PENDING, reason, now)
    return status, (act.RecordFault(pod=pod, reason=reason, counted=False),)


def _leave(
    status: JobStatus, pod: PodName, info: PodInfo, inner: Phase, reason: str, now: float
) -> JobStatus:
    """Outside RunCommand a pod goes away (lost or restarted) without a fault being counted."""
    if status.phase is Phase.PENDING:
        # Before bootcheck a pod only has to (re)ACK (once replaced, when it was lost).
        left = updates.pod(
            info, inner_phase=inner, finished=False, last_failed_reason=reason, updated_ts=now
        )
        outstanding = status.outstanding + (1 if info.finished else 0)
        return updates.status(
            status, pod_infos=status.pod_infos.set(pod, left), outstanding=outstanding
        )
    was_away = info.inner_phase in (Phase.PENDING, Phase.RESTARTING) and not info.finished
    left = updates.pod(
        info,
        inner_phase=inner,
        finished=False,
        verdict=None,
        last_failed_reason=reason,
        updated_ts=now,
    )
    return updates.status(
        status,
        pod_infos=status.pod_infos.set(pod, left),
        outstanding=status.outstanding + (1 if info.finished else 0),
        away=status.away + (0 if was_away else 1),
    )


# ---------------------------------------------------------------------------------------------
# Slowdowns (the safe point and drains: ``departures``).


def _on_slowdown(status: JobStatus, now: float) -> Result:
    """Training slowed down: stop it and run the checks, nothing counted. A pod they find slow
    is marked and leaves at the next committed checkpoint; if none is, training restarts in
    place. While a pod waits to leave at a checkpoint (slow, or drained: ranks may hold after
    saving), or once a pod has finished (the job is ending), a slowdown is expected: ignored."""
    if status.phase is not Phase.RUN_COMMAND:
        return rounds.reject(status, act.RejectReason.IGNORED, f"slowdown in {status.phase}")
    if status.outstanding < len(status.pod_infos):
        return rounds.reject(
            status, act.RejectReason.IGNORED, "pods have finished: the job is ending"
        )
    if status.slow_count + status.drain_count > 0:
        return rounds.reject(
            status, act.RejectReason.IGNORED, "a pod leaves at the next checkpoint"
        )
    return rounds.start_round(status, Phase.TROUBLESHOOTING, Order.TROUBLESHOOT, now)
