"""The event log (``events.jsonl``): one JSON object per line, every event the master fed the core.

Line 1 is ``JobCreated`` (spec and initial placement); then wire messages (as on the wire) and
platform and operator events (``PodRestarted``, ``HeartbeatLost``, ``JoinTimedOut``, ``NodeDown``,
``QuitRequested``, ``CheckpointCommitted``, ``DrainRequested``, ``DrainForced``,
``SlowdownReported``, and
``HangJudged``: every pod's hang report and the pod it is about), each with
the ``ts`` the master passed to ``step`` as ``now``. ``aegis replay`` feeds the same lines
through the same ``step`` and so reproduces every decision.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, get_args

import msgspec

from aegis.core import events as ev
from aegis.core.errors import RemoteError
from aegis.core.model import JobSpec, JobStatus, NodeName, PodName, initial_status
from aegis.core.phases import Phase
from aegis.wire import messages as m
from aegis.wire.codec import WireError
from aegis.wire.translate import to_event

MAX_PODS = 1_000_000  # pods of one job, at most (the largest runs are 10^5 GPUs)


class SpecRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    job: str
    namespace: str
    # a log's word, read before anything is built of it (3e9 pods: 9 GB of pod names)
    worker_num: Annotated[int, msgspec.Meta(ge=1, le=MAX_PODS)]
    max_retry: Annotated[int, msgspec.Meta(ge=0, le=m.INT_BOUND)]
    software_restart: bool = False  # absent: a log of the rules before it existed
    repeat_limit: int = 0  # absent likewise: no restart-or-stop


class _Record(
    msgspec.Struct,
    tag=lambda name: name.removesuffix("Record"),
    tag_field="type",
    forbid_unknown_fields=True,
):
    """A platform or operator record: tagged in ``type`` with its class name less ``Record``
    (the name of the core event it stands for)."""


class JobCreated(_Record):
    spec: SpecRecord
    ts: float
    nodes: list[str] = []
    pod_ips: list[str] = []  # absent: no pod's address was known at the start


class PodRestartedRecord(_Record):
    pod: str
    ts: float
    node: str | None = None
    pod_ip: str | None = None


class HeartbeatLostRecord(_Record):
    pod: str
    ts: float


class JoinTimedOutRecord(_Record):
    pod: str
    ts: float
    reason: str = "did not come back"


class NodeDownRecord(_Record):
    """The platform found a node itself gone (a host, not one of its pods)."""

    node: str
    ts: float
    reason: str = "node down"


class QuitRequestedRecord(_Record):
    ts: float
    reason: str = "stopped by user"


class CheckpointCommittedRecord(_Record):
    """Every pod has committed ``step`` (the master aggregates the pods' reports)."""

    step: int
    ts: float


class DrainRequestedRecord(_Record):
    """``aegis ctl drain``: these pods' node is being drained."""

    pods: list[str]
    ts: float
    reason: str = "drained"


class DrainForcedRecord(_Record):
    """The drain stopped waiting for a checkpoint (deadline, or a script without the API)."""

    pods: list[str]
    ts: float
    reason: str = "drain deadline passed"


class SlowdownReportedRecord(_Record):
    """The master's pace watch: the job's step rate fell well below its earlier pace."""

    ts: float
    reason: str = "training slowed down"


class HangReportRecord(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One pod's hang report, as its agent sent it."""

    pod: str
    idle_s: float
    stacks: str = ""
    timeout_s: float = 0.0
    why: str = ""


class HangJudgedRecord(_Record):
    """The master's reading of a hang: every pod's report of it (stacks), and the pod it is
    about (``blame``), or the first reporter with ``blame`` false when none stood out."""

    pod: str
    phase: Phase
    seq: int
    ts: float
    reason: str
    blame: bool = True
    suspect_why: str = ""
    reports: list[HangReportRecord] = []


PlatformRecord = (
    JobCreated
    | PodRestartedRecord
    | HeartbeatLostRecord
    | JoinTimedOutRecord
    | NodeDownRecord
    | QuitRequestedRecord
    | CheckpointCommittedRecord
    | DrainRequestedRecord
    | DrainForcedRecord
    | SlowdownReportedRecord
    | HangJudgedRecord
)
_PLATFORM_TYPES = frozenset(record.__struct_config__.tag for record in get_args(PlatformRecord))


class _Head(msgspec.Struct):
    type: str


_head = msgspec.json.Decoder(_Head)
_platform = msgspec.json.Decoder(PlatformRecord)
_message = msgspec.json.Decoder(m.Message)
_encoder = msgspec.json.Encoder()


class EventLogError(RemoteError):
    """A line of an event log that cannot be replayed; ``line`` is 1-based."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line


@dataclass(frozen=True, slots=True)
class Entry:
    line: int
    ts: float
    event: ev.Event | None  # None: a line with no core meaning (heartbeat)
    text: str


def encode(record: PlatformRecord | m.Message) -> bytes:
    return _encoder.encode(record) + b"\n"


def job_created(
    spec: JobSpec, nodes: list[str], ts: float, pod_ips: list[str] | None = None
) -> JobCreated:
    rec = SpecRecord(spec.job, spec.namespace, spec.worker_num, spec.max_retry,
                     spec.software_restart, spec.repeat_limit)  # fmt: skip
    return JobCreated(spec=rec, ts=ts, nodes=nodes, pod_ips=list(pod_ips or []))


def whole_lines(text: str) -> tuple[list[str], str]:
    """The lines of an event log's ``text`` and its torn tail ("" when none).

    Lines end at ``\n`` only: a pod's reason may hold U+2028 or U+0085, written raw, at which
    ``str.splitlines`` would also break. A last line with no newline that is no record is torn
    (the master is writing it, or stopped while it did): left out, and returned as the tail.
    Text with no newline at all is one line (a header, or no event log)."""
    *lines, tail = text.split("\n")
    if not tail.strip():
        return lines, ""
    if lines:
        try:
            _decode_line(len(lines) + 1, tail)
        except EventLogError:
            return lines, tail
    return [*lines, tail], ""


def read(lines: Iterator[str]) -> tuple[JobSpec, JobStatus, Iterator[Entry]]:
    """Parse the header, then lazily the entries. Raises ``EventLogError`` on a bad line."""
    first = next(lines, None)
    if first is None:
        raise EventLogError(1, "empty event log (expected a JobCreated line)")
    header = _decode_line(1, first)
    if not isinstance(header, JobCreated):
        raise EventLogError(1, "the first line must be a JobCreated record")
    try:
        spec = JobSpec(**msgspec.structs.asdict(header.spec))
        nodes = [NodeName(n) for n in header.nodes] if header.nodes else None
        status = initial_status(spec, nodes, now=header.ts, pod_ips=header.pod_ips or None)
    except ValueError as exc:
        raise EventLogError(1, str(exc)) from None
    return spec, status, _entries(spec, lines)


def _entries(spec: JobSpec, lines: Iterator[str]) -> Iterator[Entry]:
    for number, text in enumerate(lines, start=2):
        if text.strip():
            yield entry(spec, number, text)


def entry(spec: JobSpec, number: int, text: str) -> Entry:
    """Line ``number`` (after the header) of ``spec``'s log. Raises ``EventLogError``."""
    record = _decode_line(number, text)
    match record:
        case JobCreated():
            raise EventLogError(number, "a second JobCreated record")
        case m.Message():
            try:
                event = to_event(record, job=spec.job, namespace=spec.namespace)
            except WireError as exc:
                raise EventLogError(number, str(exc)) from None
        case _:
            event = _platform_event(record)
    return Entry(line=number, ts=record.ts, event=event, text=text.strip())


def _platform_event(record: PlatformRecord) -> ev.Event | None:
    """The core event a platform or operator record stands for (None: the header)."""
    match record:
        case PodRestartedRecord(pod=pod, node=node, pod_ip=ip):
            return ev.PodRestarted(PodName(pod), NodeName(node) if node is not None else None, ip)
        case HeartbeatLostRecord(pod=pod):
            return ev.HeartbeatLost(PodName(pod))
        case JoinTimedOutRecord(pod=pod, reason=reason):
            return ev.JoinTimedOut(PodName(pod), reason)
        case NodeDownRecord(node=node, reason=reason):
            return ev.NodeDown(NodeName(node), reason)
        case QuitRequestedRecord(reason=reason):
            return ev.QuitRequested(reason)
        case CheckpointCommittedRecord(step=step):
            return ev.CheckpointCommitted(step)
        case DrainRequestedRecord(pods=pods, reason=reason):
            return ev.DrainRequested(tuple(PodName(p) for p in pods), reason)
        case DrainForcedRecord(pods=pods, reason=reason):
            return ev.DrainForced(tuple(PodName(p) for p in pods), reason)
        case SlowdownReportedRecord(reason=reason):
            return ev.SlowdownReported(reason)
        case HangJudgedRecord(pod=pod, phase=phase, seq=seq, reason=reason, blame=blame):
            return ev.HangReported(PodName(pod), phase, seq, reason, blame)
        case _:
            return None


def _decode_line(number: int, text: str) -> PlatformRecord | m.Message:
    raw = text.encode()
    try:
        head = _head.decode(raw)
        if head.type in _PLATFORM_TYPES:
            record: PlatformRecord = _platform.decode(raw)
            return record
        msg = _message.decode(raw)
    except msgspec.ValidationError as exc:
        raise EventLogError(number, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise EventLogError(number, f"not JSON ({exc})") from None
    if not isinstance(msg.data, m.PAYLOAD_FOR_TYPE[msg.type]):
        raise EventLogError(number, f"{msg.type} cannot carry this data")
    return msg
