"""Wire messages (seed section 4.3): JSON, decoded strictly into typed structs.

``Message`` is the envelope on both subjects; ``data`` is a tagged union (``kind``) whose variant
must fit the message ``type``. ``CheckResult``/``CheckResponse`` carry check outcomes.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from aegis.core.phases import Order, Phase
from aegis.core.recovery import CheckType

ID_CHARS = 256  # a report's id at most (longer: the message is malformed)

# Bounds on what a peer's numbers and short texts may be; beyond them the message is malformed
# (dropped and counted). Python's ints have no bound: a heartbeat's step of 10**400 reached the
# master's float arithmetic (a step rate) and ended the job's loop. Integers stay within what a
# float holds exactly, times within a million years either way.
INT_BOUND = 2**53
Int = Annotated[int, msgspec.Meta(ge=-INT_BOUND, le=INT_BOUND)]
Seconds = Annotated[float, msgspec.Meta(ge=-3e13, le=3e13)]
# A text the agent makes short (a node's name, why a timeout was chosen, why a request was
# declined): a longer one was not made by an agent. A pod's long texts (an error's reason and
# log lines, a check's result, stacks) are bounded by the message's size and cut where the
# master keeps them (``translate.TEXT_CHARS``).
SHORT_CHARS = 1000
Short = Annotated[str, msgspec.Meta(max_length=SHORT_CHARS)]
PATH_CHARS = 4096  # a directory's path (Linux' PATH_MAX)
HEALTH_WARNINGS = 32  # the warning signs one health report carries at most


class MessageType(enum.StrEnum):
    ACK = "ACK"
    ORDER = "Order"
    ERROR = "Error"
    FINISH = "Finish"
    HANG = "Hang"
    HEARTBEAT = "Heartbeat"
    CHECKPOINT = "Checkpoint"


# The environment of a ``checkpoint`` order (the master writes it, the agent reads it).
CKPT_REQUEST_ENV = "AEGIS_CKPT_REQUEST"  # the request's id (the RunCommand round's seq)
CKPT_STEP_ENV = "AEGIS_CKPT_STEP"  # the step every rank saves at
CKPT_HOLD_ENV = "AEGIS_CKPT_HOLD_S"  # how long ranks hold after saving
RESUME_STEP_ENV = "AEGIS_RESUME_STEP"  # the step every rank resumes from (run rounds)

# Every key an order's ``env`` may carry: the agent applies these and drops (and counts) any
# other, so an order can never set BASH_ENV, LD_PRELOAD, PYTHONPATH, ...
# A troubleshooting order names the pods the master holds hung (marked slow): only their hang
# check fails. Every pod's watchdog fires when one rank stalls a collective; the others waited.
HUNG_PODS_ENV = "AEGIS_HUNG_PODS"
# ... and every pod's straggler score from the training before it (``pod=score,...``): the
# allreduce_perf check's tie-breaker when its own figures are within noise.
STRAGGLER_SCORES_ENV = "AEGIS_STRAGGLER_SCORES"
ORDER_ENV_KEYS = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "CHECK_MASTER_PORT", RESUME_STEP_ENV,
     CKPT_REQUEST_ENV, CKPT_STEP_ENV, CKPT_HOLD_ENV, HUNG_PODS_ENV, STRAGGLER_SCORES_ENV}
)  # fmt: skip


class CheckResult(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """Optional fields are left out when at their default, so a master of an earlier version
    (which refuses unknown fields) still reads a newer agent's ordinary results."""

    check_type: CheckType
    passed: bool
    result: str
    duration_s: Seconds
    ts: Seconds
    not_applicable: bool = False
    timed_out: bool = False  # failed by overrunning its budget


class CheckResponse(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    results: list[CheckResult]


class AckData(msgspec.Struct, tag="ack", tag_field="kind", forbid_unknown_fields=True, frozen=True):
    node: Short = ""
    pod_ip: Short = ""
    incarnation: Short = ""


class OrderData(
    msgspec.Struct, tag="order", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    order: Order
    pods: list[str] = []
    exit_code: Int = 0
    env: dict[str, str] = {}  # per-incarnation environment (a fresh MASTER_PORT per run round)


class ExitData(
    msgspec.Struct, tag="exit", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    """A Finish of the training command."""

    exit_code: Int


class ChecksData(
    msgspec.Struct, tag="checks", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    """A Finish of a bootcheck or troubleshoot round."""

    response: CheckResponse


class ErrorData(
    msgspec.Struct, tag="error", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    reason: str
    fault_class: Short = ""
    exit_code: Int | None = None
    lines: list[str] = []
    step: Int | None = None  # the training's last step (None: it reported none)


class HangData(
    msgspec.Struct, tag="hang", tag_field="kind", forbid_unknown_fields=True, frozen=True,
    omit_defaults=True,
):  # fmt: skip
    idle_s: Seconds
    stacks: str = ""
    timeout_s: Seconds = 0.0  # the watchdog's timeout when it fired (0: not said)
    why: Short = ""  # how that timeout was chosen
    # the watchdog has seen no step in the run: it judged by output and CPU alone (a rank that
    # waits in a collective for a peer still at work looks the same)
    no_step_signal: bool = False


class HeartbeatData(
    msgspec.Struct, tag="heartbeat", tag_field="kind", forbid_unknown_fields=True, frozen=True,
    omit_defaults=True,
):  # fmt: skip
    step: Int | None = None
    hang_timeout: Short = ""  # the watchdog's current choice: "30 s (how it was chosen)"
    # Straggler scores (core/stragglers.py): when ``step`` ended and when this beat was sent,
    # both ``time.monotonic()`` of the pod's host (the master estimates the offset)
    step_ts: Seconds | None = None
    sent_mono: Seconds | None = None
    # the training's last input time: seconds from a step's end to its next forward (a rank
    # slow before the collective; aegis.autoprogress)
    input_s: Seconds | None = None
    hung: bool = False  # the watchdog's reported hang stands: no progress since (False: moved on)


class CheckpointData(
    msgspec.Struct, tag="checkpoint", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    step: Int


class ScriptSavedData(
    msgspec.Struct, tag="script_saved", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    """The training script saved a checkpoint of its own at ``step`` (``torch.save``, a
    distributed checkpoint: ``aegis.autoprogress``) and training has gone past it: a safe point
    for a script that takes no checkpoint requests. A master that does not know it drops it."""

    step: Int


class CheckpointDeclinedData(
    msgspec.Struct,
    tag="checkpoint_declined",
    tag_field="kind",
    forbid_unknown_fields=True,
    frozen=True,
):
    """The pod cannot answer a checkpoint request (its script does not take requests)."""

    request: Short
    reason: Short


class CheckpointStoreData(
    msgspec.Struct,
    tag="checkpoint_store",
    tag_field="kind",
    forbid_unknown_fields=True,
    frozen=True,
):
    """The pod's saver daemon could not persist to its durable directory (``failures``
    attempts since the last report, the newest one's errno; ``opened``: the first began an
    outage), or, ``ok``, it can again (after ``down_s`` seconds)."""

    directory: Annotated[str, msgspec.Meta(max_length=PATH_CHARS)]
    step: Int
    ok: bool = False
    errno: Int = 0
    strerror: Short = ""
    failures: Int = 0
    opened: bool = False
    down_s: Seconds = 0.0


class HealthData(
    msgspec.Struct, tag="health", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    """Warning signs of the pod's GPUs (``checks.gpu.health_warnings``: ECC errors, pages or
    rows pending retirement, a failed remapping, critical Xids, a GPU at its slowdown
    temperature), said at each look while they stand: the master drains the pod's node before
    the GPU fails (the node of its own record: one that differs from ``node`` is a stale
    agent's, and refused). A master that does not know it drops it."""

    warnings: Annotated[list[Short], msgspec.Meta(min_length=1, max_length=HEALTH_WARNINGS)]
    node: Short = ""  # the node the agent was placed on ("": not told): another is refused


class CommittedData(
    msgspec.Struct, tag="committed", tag_field="kind", forbid_unknown_fields=True, frozen=True
):
    """The master's word, once its record holds it, that every pod committed ``step``: the
    job may resume from it, so each pod's saver keeps it and the newest steps after it,
    whatever its ``keep`` (a pod ahead of one whose store is down pruned the step the job
    resumed from). Signed and fenced as orders are; an agent that does not know it drops it."""

    step: Annotated[int, msgspec.Meta(ge=0, le=INT_BOUND)]


Payload = (
    AckData
    | OrderData
    | CommittedData
    | ExitData
    | ChecksData
    | ErrorData
    | HangData
    | HeartbeatData
    | CheckpointData
    | ScriptSavedData
    | CheckpointDeclinedData
    | CheckpointStoreData
    | HealthData
)

# Which payload kinds each message type may carry.
PAYLOAD_FOR_TYPE: dict[MessageType, tuple[type[Payload], ...]] = {
    MessageType.ACK: (AckData,),
    MessageType.ORDER: (OrderData, CommittedData),
    MessageType.FINISH: (ExitData, ChecksData),
    MessageType.ERROR: (ErrorData,),
    MessageType.HANG: (HangData,),
    MessageType.HEARTBEAT: (HeartbeatData,),
    MessageType.CHECKPOINT: (
        CheckpointData,
        ScriptSavedData,
        CheckpointDeclinedData,
        CheckpointStoreData,
        HealthData,
    ),
}


def current_epoch(epoch: int, newest: int) -> bool:
    """Whether a message of a master leader's ``epoch`` is the current leader's, once one of
    ``newest`` came: not a deposed leader's that woke from a stall and sent what it had
    decided. The one fence of the agents' orders and of the platform's requests."""
    return epoch >= newest


class Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    """Fields at their default are left out (a master of an earlier version, which refuses
    unknown fields, still reads an unsigned report)."""

    job: str
    namespace: str
    pod: str  # "master" for the master's broadcasts
    type: MessageType
    phase: Phase
    seq: Int
    ts: Seconds
    data: Payload
    # unique per report, so a re-sent report is processed at most once (``pod/incarnation/n``;
    # bounded: the master remembers the last 65,536)
    id: Annotated[str, msgspec.Meta(max_length=ID_CHARS)] = ""
    epoch: Int = 0  # the master leader's term (orders): agents ignore orders of older terms
    sig: str = ""  # orders: the master's signature of the order encoded with sig "" (codec)
