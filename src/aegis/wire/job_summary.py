"""The user-facing summary of a job, after the seed's line: "max restarts N, restarted M times;
hardware problems rescheduled K times" (``aegis status``, and the ``.status`` the master writes
back to an AegisJob).

M is the number of recoveries the budget paid for (``aegis.core.endings.restarts``): the
counted faults but one that ended the job (in ``Failed`` after an exhausted budget the status
holds ``max_retry + 1``; a job stopped by the repeat rule counted the fault that stopped it).
K counts level-3 evictions (a pod moved off a bad node).

``summarize`` is pure; ``from_record`` reads a master's store record (the job's record in the
status bucket, as a running ``aegis master`` persists it). A record carries K as
``hardware_rescheduled`` when the master counts it; an older record does not, and K is then the
number of ErrorNodes (every node left by a level-3 eviction is one, but so is a node left by a
slow-node eviction). ``aegis.tools.status_summary`` builds the same summary from a log
directory.

A summary says why an ended job ended: its kind (``ending``, :mod:`aegis.core.endings`, from the
status) and the master's words (``ended``: a record's ``ended``, or the ``EndJob`` reason a log
replay finds; "" where neither says).

A running master's record also carries the straggler scores (``stragglers``: each pod's score
in steps behind its peers, the pod named a straggler and why; :class:`aegis.master.pace.
StragglerWatch`), shown per pod.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aegis.core.endings import Ending, ending, restarts
from aegis.core.model import JobSpec, JobStatus, PodName, pods_by_rank
from aegis.core.phases import Phase
from aegis.wire import status_json


@dataclass(frozen=True, slots=True)
class PodRow:
    pod: str
    node: str
    inner_phase: str
    retries: int
    last_failed_reason: str
    watchdog: str = ""  # the pod's hang watchdog: its timeout and how it was chosen
    straggler_score: float | None = None  # steps behind its peers (None: no score)


@dataclass(frozen=True, slots=True)
class Summary:
    job: str
    phase: Phase
    max_restarts: int
    restarted: int
    hardware_rescheduled: int
    should_quit: bool
    error_nodes: tuple[str, ...]
    pods: tuple[PodRow, ...]
    status: dict[str, Any]
    straggler: str = ""  # "<node> (pod P, why)" when the master names one
    straggler_pod: str = ""
    ending: Ending | None = None  # how it ended (None: it runs)
    ended: str = ""  # why, in the master's words ("" where unknown)

    @property
    def outcome(self) -> str:
        """The phase, and for an ended job why: ``Failed: fault budget exhausted``."""
        if self.ending is None or self.ending is Ending.SUCCEEDED:
            return self.phase.value
        return f"{self.phase.value}: {self.ended or self.ending.value}"

    @property
    def user_line(self) -> str:
        return (
            f"max restarts {self.max_restarts}, restarted {self.restarted} times; "
            f"hardware problems rescheduled {self.hardware_rescheduled} times"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "phase": self.phase.value,
            "user_line": self.user_line,
            "max_restarts": self.max_restarts,
            "restarted": self.restarted,
            "hardware_rescheduled": self.hardware_rescheduled,
            "should_quit": self.should_quit,
            "error_nodes": list(self.error_nodes),
            "pods": [_row(p) for p in self.pods],
            "straggler": self.straggler,
            "ending": self.ending.value if self.ending is not None else None,
            "ended": self.ended,
            **self.status,
        }


def _row(p: PodRow) -> dict[str, Any]:
    return {"pod": p.pod, "node": p.node, "inner_phase": p.inner_phase, "retries": p.retries,
            "last_failed_reason": p.last_failed_reason, "watchdog": p.watchdog,
            "straggler_score": p.straggler_score}  # fmt: skip


def summarize(
    spec: JobSpec,
    status: JobStatus,
    hardware_rescheduled: int,
    watchdogs: dict[str, str] | None = None,
    stragglers: StragglerScores | None = None,
    ended: str = "",
) -> Summary:
    """``watchdogs``: each pod's hang watchdog as its agent last said; ``stragglers``: the
    straggler scores (both a running master's); ``ended``: why it ended, as the master said."""
    said = watchdogs or {}
    scored = stragglers or StragglerScores({}, "", "")
    rows = tuple(
        PodRow(
            pod,
            str(info.node),
            info.inner_phase.value,
            info.retries,
            info.last_failed_reason,
            str(said.get(pod, "")),
            scored.scores.get(pod),
        )
        for pod, info in pods_by_rank(status)
    )
    named = ""
    if scored.named:
        info = status.pod_infos.get(PodName(scored.named))
        node = str(info.node) if info is not None and info.node else "?"
        named = f"{node} (pod {scored.named}, {scored.why})"
    return Summary(
        job=spec.job,
        phase=status.phase,
        max_restarts=spec.max_retry,
        restarted=restarts(spec, status),
        hardware_rescheduled=hardware_rescheduled,
        should_quit=status.should_quit,
        error_nodes=tuple(str(e.node) for e in status.error_nodes),
        pods=rows,
        status=status_json.to_dict(spec, status),
        straggler=named,
        straggler_pod=scored.named,
        ending=ending(spec, status),
        ended=ended,
    )


HARDWARE_RESCHEDULED = "hardware_rescheduled"


def from_record(record: dict[str, Any]) -> Summary:
    """The summary of a job record read from the master's store (``status_json`` fields plus
    the master's extras); raises ``KeyError``/``ValueError`` on a record of another shape."""
    spec, status = status_json.from_dict(record)
    counted = record.get(HARDWARE_RESCHEDULED)
    rescheduled = int(counted) if counted is not None else len(status.error_nodes)
    watchdogs = record.get("watchdogs")
    return summarize(
        spec,
        status,
        rescheduled,
        watchdogs if isinstance(watchdogs, dict) else None,
        straggler_scores(record.get("stragglers")),
        str(record.get("ended") or ""),
    )


@dataclass(frozen=True, slots=True)
class StragglerScores:
    scores: dict[str, float]  # pod -> steps behind its peers
    named: str  # the pod named a straggler ("": none)
    why: str


def straggler_scores(stored: object) -> StragglerScores | None:
    """The record's ``stragglers`` entry; None when absent; ``ValueError`` when malformed."""
    if stored is None:
        return None
    if not isinstance(stored, dict) or not isinstance(stored.get("scores", {}), dict):
        raise ValueError(f"stragglers: expected {{'scores': {{pod: score}}, ...}}, got {stored!r}")
    try:
        scores = {str(pod): float(v) for pod, v in stored.get("scores", {}).items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"stragglers: a score is not a number: {exc}") from None
    return StragglerScores(scores, str(stored.get("named", "")), str(stored.get("why", "")))
