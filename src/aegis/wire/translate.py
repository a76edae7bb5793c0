"""Turn a decoded wire message into the core event it means (or nothing, for heartbeats)."""

from __future__ import annotations

import ipaddress
import re

from aegis.core import events as ev
from aegis.core.model import PodName
from aegis.core.recovery import CheckOutcome, Classification, classify
from aegis.wire import messages as m
from aegis.wire.codec import WireError

# What of a peer's free text (an error's reason, the failing checks' results) an event carries
# into the job's record: the record is one value in the store, under the server's payload limit
# (a report of 250 KB made it too large to persist, which ended the job's loop). The whole text
# stays in the event log.
TEXT_CHARS = 2000
CLASS_CHARS = 64  # a fault class is a short name (``FaultClass``)


def to_event(msg: m.Message, *, job: str, namespace: str) -> ev.Event | None:
    """The core event for ``msg``; ``None`` for a heartbeat, an order or a declined checkpoint
    request (the master's shell decides on those); ``WireError`` when the
    message belongs to another job."""
    if msg.job != job or msg.namespace != namespace:
        raise WireError("wrong_job", detail=f"{msg.namespace}/{msg.job} on {namespace}/{job}")
    pod = PodName(msg.pod)
    match msg.data:
        case m.AckData(pod_ip=ip):
            return ev.PodAcked(pod, ip if is_address(ip) else None)
        case m.ExitData(exit_code=code):
            return ev.PodFinished(pod, msg.phase, msg.seq, code)
        case m.ChecksData(response=response):
            verdict = verdict_of(response)
            return ev.ChecksReported(pod, msg.phase, msg.seq, verdict, failing_checks(response))
        case m.ErrorData(reason=reason, fault_class=fault_class, step=step):
            cls = fault_class[:CLASS_CHARS]
            label = f"{cls}: {reason}" if cls else reason
            return ev.PodErrored(pod, msg.phase, msg.seq, label[:TEXT_CHARS], cls, step)
        case m.HangData(idle_s=idle_s):
            return ev.HangReported(pod, msg.phase, msg.seq, f"hang: no progress for {idle_s:.1f} s")
        case m.CheckpointData(step=step):
            return ev.CheckpointCommitted(step)
        case m.HeartbeatData() | m.CheckpointDeclinedData() | m.ScriptSavedData():
            return None
        case m.OrderData() | m.CommittedData():  # the master's word (``inbox`` drops it)
            return None
        case m.CheckpointStoreData() | m.HealthData():  # the master's shell handles them
            return None


_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def is_address(text: str) -> bool:
    """An IP address or a DNS name (a peer's word on where it is: anything else is ignored)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return bool(_HOSTNAME.match(text))
    return True


def verdict_of(response: m.CheckResponse) -> Classification:
    return classify(CheckOutcome(r.check_type, r.passed, r.timed_out) for r in response.results)


def failing_checks(response: m.CheckResponse) -> str:
    failed = [f"{r.check_type}: {r.result}" for r in response.results if not r.passed]
    return "; ".join(failed)[:TEXT_CHARS]
