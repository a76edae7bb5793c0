"""A job runner's inbox: what reaches the job, checked before it is queued (no I/O, no clock).

A worker's message is decoded strictly; malformed, oversized, wrong-job and stale-shaped input,
an order (no report), a pod the job does not have, and a report on another pod's subject are
dropped and counted (``DropCounter``). A platform event gets the record the event log keeps of
it. Both become one queue item, handled in order by the runner's loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegis.adapters.nats_auth import worker_subject
from aegis.core import events as ev
from aegis.core.errors import LocalError
from aegis.core.model import JobSpec, JobStatus, PodName
from aegis.master.drops import DropCounter
from aegis.wire import codec, eventlog
from aegis.wire import messages as m
from aegis.wire.translate import to_event


@dataclass(frozen=True, slots=True)
class PlatformInput:
    """An event from the platform, the control channel or the runner's own watches."""

    event: ev.Event
    record: eventlog.PlatformRecord
    evidence: tuple[m.Message, ...] = ()  # agent reports the record stands for (observers)


@dataclass(frozen=True, slots=True)
class MessageInput:
    """An agent's report that is an event for the core."""

    msg: m.Message
    event: ev.Event


Input = PlatformInput | MessageInput


@dataclass(frozen=True, slots=True)
class Report:
    """A worker's message that passed the checks: its pod, and its event (None: a heartbeat
    or a report the runner handles itself)."""

    pod: PodName
    msg: m.Message
    event: ev.Event | None


def accept(
    subject: str, payload: bytes, spec: JobSpec, status: JobStatus, prefix: str, drops: DropCounter
) -> Report | None:
    """The report on ``<prefix>.worker.<pod>``, or None (dropped and counted). A report counts
    only on its own pod's subject (the one its credentials may publish on): pod 1 cannot speak
    for pod 0."""
    try:
        msg = codec.decode(payload)
        event = to_event(msg, job=spec.job, namespace=spec.namespace)
    except codec.WireError as exc:
        drops.add(exc.reason, str(exc))  # logged at a bounded rate, counted exactly
        return None
    if msg.type is m.MessageType.ORDER:  # the master's word: no pod may say it
        drops.add("not_a_report", f"an order from pod {msg.pod}")
        return None
    pod = PodName(msg.pod)
    if pod not in status.pod_infos:
        drops.add("unknown_pod", f"from pod {msg.pod}")
        return None
    if subject != worker_subject(prefix, pod):
        drops.add("wrong_pod", f"pod {msg.pod} reported on {subject}")
        return None
    return Report(pod, msg, event)


def platform_record(event: ev.Event, now: float) -> eventlog.PlatformRecord:
    """What the event log keeps of a platform event; ``LocalError`` for one that is not."""
    match event:
        case ev.PodRestarted(pod=pod, node=node, pod_ip=ip):
            return eventlog.PodRestartedRecord(pod=pod, ts=now, node=node, pod_ip=ip)
        case ev.HeartbeatLost(pod=pod):
            return eventlog.HeartbeatLostRecord(pod=pod, ts=now)
        case ev.JoinTimedOut(pod=pod, reason=reason):
            return eventlog.JoinTimedOutRecord(pod=pod, ts=now, reason=reason)
        case ev.NodeDown(node=node, reason=reason):
            return eventlog.NodeDownRecord(node=node, ts=now, reason=reason)
        case ev.QuitRequested(reason=reason):
            return eventlog.QuitRequestedRecord(ts=now, reason=reason)
        case ev.CheckpointCommitted(step=step):
            return eventlog.CheckpointCommittedRecord(step=step, ts=now)
        case ev.DrainRequested(pods=pods, reason=reason):
            return eventlog.DrainRequestedRecord(list(pods), ts=now, reason=reason)
        case ev.DrainForced(pods=pods, reason=reason):
            return eventlog.DrainForcedRecord(list(pods), ts=now, reason=reason)
        case ev.SlowdownReported(reason=reason):
            return eventlog.SlowdownReportedRecord(ts=now, reason=reason)
        case _:
            raise LocalError(f"not a platform event: {event!r}")


def operator_hang(pod: PodName, reason: str, status: JobStatus, now: float) -> PlatformInput:
    """A hang of ``pod`` named from outside (``aegis ctl hang``): no window, it is blamed."""
    report = eventlog.HangReportRecord(pod, 0.0, reason)
    record = eventlog.HangJudgedRecord(pod, status.phase, status.seq, now, reason, True,
                                       "named by the operator", [report])  # fmt: skip
    return PlatformInput(ev.HangReported(pod, status.phase, status.seq, reason, True), record)
