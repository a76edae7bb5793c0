"""Incidents of a job, rebuilt from its replayed ``events.jsonl`` (``aegis incidents``).

Incidents open and close by the rule of ``core.incidents``, the one the master's fault log and
metrics use, so incident ids agree with ``faults.jsonl``. Evidence comes
from the agents' reports recorded in the event log: matched log lines and fault class (Error),
stack dumps (the master's ``HangJudged`` record: every pod's, and the suspect it named; a Hang
report in an older log), check results (troubleshooting Finish).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.incidents import Change, IncidentTracker
from aegis.core.model import JobStatus, PodName, rank_of
from aegis.core.phases import Order, Phase
from aegis.core.recovery import LEVEL_NAMES, RecoveryLevel
from aegis.tools import replay
from aegis.wire import eventlog
from aegis.wire import messages as m
from aegis.wire.translate import verdict_of


@dataclass(frozen=True, slots=True)
class Evidence:
    ts: float
    pod: str
    kind: str  # "log" (matched lines), "checks", "stacks", "exit"
    summary: str
    lines: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Decision:
    ts: float
    text: str
    level: str | None = None


@dataclass(slots=True)
class Incident:
    id: str
    detected_ts: float
    detected_by: str
    pod: str
    node: str
    reason: str
    phase: Phase
    counted: bool = False
    level: RecoveryLevel | None = None
    evidence: list[Evidence] = field(default_factory=list)
    classification: dict[str, str] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    closed_ts: float | None = None
    outcome: Phase | None = None
    suspect: str = ""  # a hang's: "<pod> (rank R, node N): <why>"

    @property
    def level_name(self) -> str | None:
        return LEVEL_NAMES[self.level] if self.level is not None else None

    @property
    def recovery_s(self) -> float | None:
        return None if self.closed_ts is None else self.closed_ts - self.detected_ts

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "detected_ts": self.detected_ts, "detected_by": self.detected_by,
            "pod": self.pod, "node": self.node, "reason": self.reason, "phase": self.phase.value,
            "counted": self.counted, "level": self.level_name,
            "evidence": [_ev_dict(e) for e in self.evidence],
            "classification": self.classification,
            "decisions": [{"ts": d.ts, "text": d.text, "level": d.level} for d in self.decisions],
            "closed_ts": self.closed_ts,
            "outcome": self.outcome.value if self.outcome else None,
            "recovery_s": self.recovery_s, "suspect": self.suspect,
        }  # fmt: skip


def _ev_dict(e: Evidence) -> dict[str, Any]:
    return {"ts": e.ts, "pod": e.pod, "kind": e.kind, "summary": e.summary, "lines": list(e.lines)}


_message = msgspec.json.Decoder(m.Message)
_judged = msgspec.json.Decoder(eventlog.HangJudgedRecord)


def hang_judged(entry_text: str) -> eventlog.HangJudgedRecord | None:
    """The master's judgement of a hang recorded on this line, if it is one."""
    if '"HangJudged"' not in entry_text:
        return None
    try:
        return _judged.decode(entry_text.encode())
    except msgspec.DecodeError:
        return None


def hang_evidence(judged: eventlog.HangJudgedRecord, ts: float) -> list[Evidence]:
    """Every pod's stacks of the hang, as each reported them."""
    return [
        Evidence(
            ts, r.pod, "stacks", f"no progress for {r.idle_s:.1f} s", tuple(r.stacks.splitlines())
        )
        for r in judged.reports
    ]


def suspect_line(judged: eventlog.HangJudgedRecord, status: JobStatus) -> str:
    """``<pod> (rank R, node N): <why>`` of a hang that named one; "" when none was."""
    if not judged.blame:
        return ""
    info = status.pod_infos.get(PodName(judged.pod))
    node = info.node if info is not None else "?"
    return f"{judged.pod} (rank {rank_of(PodName(judged.pod))}, node {node}): {judged.suspect_why}"


# What detected an incident, by the event that opened it ({field}: the event's field).
_DETECTED_BY: dict[type[ev.Event], str] = {
    ev.PodErrored: "agent error report",
    ev.HangReported: "hang watchdog (no progress)",
    ev.HeartbeatLost: "heartbeat loss",
    ev.JoinTimedOut: "not back in time ({reason})",
    ev.PodRestarted: "platform: pod restarted",
    ev.PodFinished: "training exit code {exit_code}",
    ev.ChecksReported: "checks",
    ev.CheckpointCommitted: "slow mark, evicted at a committed checkpoint",
    ev.QuitRequested: "quit requested",
    ev.DrainRequested: "drain of the node ({reason})",
    ev.DrainForced: "drain forced: {reason}",
    ev.SlowdownReported: "pace watch: {reason}",
}


def detected_by(event: ev.Event, opener: act.Action | None = None) -> str:
    """``opener``: the action that opened the incident (a commit evicts a pod marked slow, or
    one whose node is drained)."""
    drained = isinstance(opener, act.EvictPod) and opener.level is RecoveryLevel.DRAIN
    if drained and isinstance(event, ev.CheckpointCommitted):
        return "drain of the node, left at a committed checkpoint"
    template = _DETECTED_BY.get(type(event))
    if template is None:
        return type(event).__name__
    return template.format(**dataclasses.asdict(event))


def decision(action: act.Action) -> Decision | None:
    match action:
        case act.RecordFault(pod=pod, reason=reason, counted=counted):
            note = "counted (fault budget spent)" if counted else "not counted"
            return Decision(0.0, f"{pod}: fault {note}: {reason}")
        case act.EvictPod(pod=pod, level=level, reason=reason):
            text = f"{pod}: leaves its node, level {int(level)} {LEVEL_NAMES[level]}: {reason}"
            return Decision(0.0, text, LEVEL_NAMES[level])
        case act.ReplacePod(pod=pod, reason=reason):
            return Decision(0.0, f"{pod}: replaced: {reason}", LEVEL_NAMES[RecoveryLevel.CONTAINER])
        case act.BlacklistNode(node=node, reason=reason):
            return Decision(0.0, f"node {node} joins ErrorNodes: {reason}")
        case act.SendOrder(order=Order.RESTART):
            return Decision(0.0, "restart every pod in place", "in_place")
        case act.SendOrder(order=Order.TROUBLESHOOT):
            return Decision(0.0, "stop training, run the checks on every pod")
        case act.EndJob(phase=phase, reason=reason):
            return Decision(0.0, f"job {phase.value}: {reason}")
        case _:
            return None


def evidence_of(entry_text: str, ts: float) -> tuple[Evidence | None, tuple[str, str] | None]:
    """Evidence in one recorded agent report, and (pod, classification) for check results."""
    try:
        msg = _message.decode(entry_text.encode())
    except msgspec.DecodeError:
        return None, None  # a platform record
    match msg.data:
        case m.ErrorData(reason=reason, fault_class=cls, exit_code=code, lines=lines):
            head = f"{cls}: {reason}" if cls else reason
            tail = f" (exit code {code})" if code is not None else ""
            return Evidence(ts, msg.pod, "log", head + tail, tuple(lines)), None
        case m.HangData(idle_s=idle_s, stacks=stacks):
            summary = f"no progress for {idle_s:.1f} s"
            return Evidence(ts, msg.pod, "stacks", summary, tuple(stacks.splitlines())), None
        case m.ChecksData(response=response):
            checks = tuple(
                f"{r.check_type}: {'n/a' if r.not_applicable else 'PASS' if r.passed else 'FAIL'}"
                f" ({r.duration_s:.2f} s) {r.result}"
                for r in response.results
            )
            failed = [r.check_type.value for r in response.results if not r.passed]
            summary = "failed: " + ", ".join(failed) if failed else "all checks passed"
            verdict = verdict_of(response).value
            return Evidence(ts, msg.pod, "checks", summary, checks), (msg.pod, verdict)
        case m.ExitData(exit_code=code) if code != 0:
            return Evidence(ts, msg.pod, "exit", f"training exited {code}"), None
        case _:
            return None, None


def incidents(job: str, initial: JobStatus, steps: Iterable[replay.Replayed]) -> list[Incident]:
    found: list[Incident] = []
    tracker = IncidentTracker(job)
    phase, before = initial.phase, initial
    for done in steps:
        assert done.entry.event is not None
        event, ts, after = done.entry.event, done.entry.ts, done.status
        change = tracker.feed(phase, event, after, done.actions, ts)
        if change.opened is not None:
            found.append(_opened(change, ts, event, phase, before))
        core = change.closed or tracker.current
        if core is not None:
            current = found[-1]
            assert current.id == core.id
            _gather(current, done, phase, before, ts)
            current.counted, current.level = core.counted, core.level
            current.closed_ts, current.outcome = core.closed_ts, core.outcome
        phase, before = after.phase, after
    return found


def _opened(
    change: Change, ts: float, event: ev.Event, phase: Phase, before: JobStatus
) -> Incident:
    """The record of an incident opened by ``event`` (at ``change.opener``, or a slowdown)."""
    assert change.opened is not None
    action = change.opener
    pod = str(getattr(action, "pod", "")) if action is not None else ""
    info = before.pod_infos.get(PodName(pod)) if pod else None
    reason = getattr(action if action is not None else event, "reason", "")
    return Incident(
        id=change.opened.id, detected_ts=ts, detected_by=detected_by(event, action), pod=pod,
        node=str(info.node) if info else "", reason=str(reason), phase=phase,
    )  # fmt: skip


def _gather(
    current: Incident, done: replay.Replayed, phase: Phase, before: JobStatus, ts: float
) -> None:
    """The decisions and evidence of one replayed event, into its incident."""
    for action in done.actions:
        note = decision(action)
        if note is not None:
            current.decisions.append(Decision(ts, note.text, note.level))
    judged = hang_judged(done.entry.text)
    if judged is not None:
        current.evidence.extend(hang_evidence(judged, ts))
        current.suspect = current.suspect or suspect_line(judged, before)
    evidence, verdict = evidence_of(done.entry.text, ts)
    if evidence is not None and (evidence.kind != "checks" or phase in _CHECKING):
        current.evidence.append(evidence)
    if verdict is not None:
        pod, cls = verdict
        seen = current.classification.get(pod)
        if seen is not None and not seen.endswith(cls):
            cls = f"{seen} -> {cls}"
        current.classification[pod] = seen if seen and seen.endswith(cls) else cls


_CHECKING = frozenset({Phase.BOOT_CHECKING, Phase.TROUBLESHOOTING})


def hardware_reschedules(steps: Iterable[replay.Replayed]) -> int:
    """How many times a pod was moved off a bad node (level 3 evictions)."""
    return sum(
        1
        for done in steps
        for action in done.actions
        if isinstance(action, act.EvictPod) and action.level is RecoveryLevel.NODE
    )


@dataclass(slots=True)
class StoreOutage:
    """A pod's durable checkpoint directory down (full, read-only, gone) and, once it came
    back, for how long: training went on from the checkpoints in shared memory meanwhile."""

    pod: str
    directory: str
    errno: int
    strerror: str
    step: int  # the newest step kept in memory when it went down
    began_ts: float
    failures: int = 0  # failed attempts to persist, as the pod reported them
    ended_ts: float | None = None
    down_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "checkpoint_store_outage", "pod": self.pod, "directory": self.directory,
                "errno": self.errno, "strerror": self.strerror, "step": self.step,
                "began_ts": self.began_ts, "failures": self.failures,
                "ended_ts": self.ended_ts, "down_s": self.down_s}  # fmt: skip


def store_outages(lines: Iterable[str]) -> list[StoreOutage]:
    """Every checkpoint store outage the pods reported, in an ``events.jsonl`` (the master
    records each report there; a line that is no such report is skipped)."""
    found: list[StoreOutage] = []
    open_by_pod: dict[str, StoreOutage] = {}
    for text in lines:
        if '"checkpoint_store"' not in text:
            continue
        try:
            msg = _message.decode(text.encode())
        except msgspec.DecodeError:
            continue
        data = msg.data
        if not isinstance(data, m.CheckpointStoreData):
            continue
        current = open_by_pod.get(msg.pod)
        if data.opened or (current is None and not data.ok):
            current = StoreOutage(msg.pod, data.directory, data.errno, data.strerror, data.step,
                                  msg.ts)  # fmt: skip
            open_by_pod[msg.pod] = current
            found.append(current)
        if current is None:
            continue
        current.failures += max(data.failures, 0)
        if data.ok:
            current.ended_ts, current.down_s = msg.ts, data.down_s
            del open_by_pod[msg.pod]
    return found
