"""A hang is judged once, from every pod's report of it, not from whichever watchdog fired first.

When a synchronous job stalls, every pod's watchdog fires within a moment of the others: the
stuck rank's and those of all the ranks that wait for it. The first report of a training round
opens a short window (``gather_s``: at least ``min_s``, a fifth of the reporter's timeout, at most
``max_s``); it closes early once every running pod has reported. Then ``core.suspects`` names
the pod the hang is about from the stacks, and one ``HangJudged`` record (all the reports, the
verdict) becomes the core's ``HangReported`` for that pod, or for the first reporter with
``blame`` off when none stands out: no healthy pod is marked slow for another's hang.

Two things are no hang. A report whose pod's heartbeats then say its training moved again
(``hung`` no more) is withdrawn. And when every report held was judged with no step signal
(output and CPU alone) while a running pod has not reported, the reporters wait in a collective
for a pod still at work (rank 0 preparing data before a barrier, as scripts do): the window
then waits on, until that pod stalls too (every pod reported), stops running, or has worked
``work_s`` (600 s, NCCL's own collective timeout) since the round's reports began to wait,
withdrawals and new reports between included: then the hang is judged. In a job with no step
signal at all this holds for its whole run: a hang in which one rank keeps busy or printing
while the others wait is judged after ``work_s``, not at the window's close.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aegis.core import events as ev
from aegis.core.model import JobStatus, PodName, rank_of
from aegis.core.phases import Phase
from aegis.core.suspects import name_suspect
from aegis.wire import eventlog
from aegis.wire import messages as m
from aegis.wire.translate import TEXT_CHARS


@dataclass(frozen=True, slots=True)
class GatherSettings:
    min_s: float = 5.0
    max_s: float = 60.0
    share: float = 0.2  # of the first reporter's timeout
    work_s: float = 600.0  # how long reports with no step signal wait for a pod still at work

    def window_s(self, timeout_s: float) -> float:
        return min(self.max_s, max(self.min_s, self.share * timeout_s))


@dataclass(slots=True)
class HangJudge:
    settings: GatherSettings = field(default_factory=GatherSettings)
    seq: int = -1  # the round the held reports belong to
    held: dict[PodName, m.Message] = field(default_factory=dict)  # in arrival order
    opened: int = 0  # windows opened (a close scheduled for a window withdrawn is no other's)
    said_hung: set[PodName] = field(default_factory=set)  # pods whose beats told a hang, this round
    # when the round's reports began to wait for pods at work (kept across withdrawals)
    waiting_since: float | None = None
    waiting: bool = False  # the held reports wait for pods at work (their window closed)

    def hold(self, status: JobStatus, msg: m.Message) -> float | None:
        """Keep a hang report of the current training round. Returns the window to wait when
        it is the round's first, 0.0 when the round's reports are complete, None when it was
        held as one more, and raises ``LookupError`` when it is not this round's to judge (the
        core decides about it as about any stale message)."""
        pod = PodName(msg.pod)
        current = msg.phase is Phase.RUN_COMMAND and status.phase is Phase.RUN_COMMAND
        if not current or msg.seq != status.seq or (pod in self.held and msg.seq == self.seq):
            raise LookupError(msg.id)
        self._round(msg.seq)
        self.held[pod] = msg
        if len(self.held) == 1:
            self.opened += 1
        if self.complete(status):
            return 0.0
        if len(self.held) == 1:
            assert isinstance(msg.data, m.HangData)
            return self.settings.window_s(msg.data.timeout_s)
        return None

    def _round(self, seq: int) -> None:
        if seq != self.seq:
            self.seq, self.held, self.said_hung = seq, {}, set()
            self.waiting_since, self.waiting = None, False

    def withdraw(self, status: JobStatus, msg: m.Message) -> bool:
        """A heartbeat of the current round: whether it withdrew its pod's held report (its
        training moved again). Only a pod whose beats told the hang before can withdraw it (an
        agent of an earlier version tells none)."""
        beat, pod = msg.data, PodName(msg.pod)
        if not isinstance(beat, m.HeartbeatData) or msg.seq != status.seq:
            return False
        if pod not in status.pod_infos:
            return False
        self._round(msg.seq)
        if beat.hung:
            self.said_hung.add(pod)
            return False
        if pod not in self.said_hung or self.held.pop(pod, None) is None:
            return False
        self.waiting = self.waiting and bool(self.held)
        return True

    def waits_for_work(self, status: JobStatus) -> list[PodName]:
        """The running pods the held reports wait for (none: judge now): those that did not
        report, when every report held was judged with no step signal."""
        quiet = all(isinstance(msg.data, m.HangData) and msg.data.no_step_signal
                    for msg in self.held.values())  # fmt: skip
        return [p for p in running(status) if p not in self.held] if quiet and self.held else []

    def wait_left(self, status: JobStatus, now: float) -> float:
        """At a window's close (``now``: monotonic): how long the held reports still wait for
        pods at work (0: judge now). The wait is counted from the round's first one."""
        if not self.waits_for_work(status):
            return 0.0
        if self.waiting_since is None:
            self.waiting_since = now
        self.waiting = True
        return max(0.0, self.waiting_since + self.settings.work_s - now)

    def complete(self, status: JobStatus) -> bool:
        return all(pod in self.held for pod in running(status))

    def judge(
        self, status: JobStatus, now: float
    ) -> tuple[ev.HangReported, eventlog.HangJudgedRecord]:
        """The round's verdict; forgets the held reports."""
        held, self.held, self.waiting = self.held, {}, False
        reports = [_report(msg) for msg in held.values()]
        first = next(iter(held.values()))
        stacks = {r.pod: r.stacks for r in reports}
        suspect = name_suspect(stacks, [str(p) for p in running(status)])
        head = _head(first)
        if suspect is not None:
            info = status.pod_infos.get(PodName(suspect.pod))
            node = info.node if info is not None else "?"
            where = f"rank {rank_of(PodName(suspect.pod))}, node {node}"
            pod, blame, why = suspect.pod, True, suspect.why
            reason = f"{head}; suspect: {pod} ({where}): {why}"
        else:
            pod, blame, why = first.pod, False, ""
            reason = f"{head}; no suspect: the stacks of {len(held)} pod(s) single none out"
        reason, why = reason[:TEXT_CHARS], why[:TEXT_CHARS]  # a frame's name: a peer's text
        record = eventlog.HangJudgedRecord(
            pod=pod, phase=first.phase, seq=first.seq, ts=now, reason=reason, blame=blame,
            suspect_why=why, reports=reports,
        )  # fmt: skip
        event = ev.HangReported(PodName(pod), first.phase, first.seq, reason, blame)
        return event, record

    def messages(self) -> tuple[m.Message, ...]:
        return tuple(self.held.values())


def running(status: JobStatus) -> list[PodName]:
    """The pods whose training runs now (a hang report is expected from each)."""
    return [
        pod for pod, info in status.pod_infos.items()
        if info.inner_phase is Phase.RUN_COMMAND and not info.finished
    ]  # fmt: skip


def _report(msg: m.Message) -> eventlog.HangReportRecord:
    assert isinstance(msg.data, m.HangData)
    data = msg.data
    return eventlog.HangReportRecord(msg.pod, data.idle_s, data.stacks, data.timeout_s, data.why)


def _head(msg: m.Message) -> str:
    assert isinstance(msg.data, m.HangData)
    data = msg.data
    timeout = f" (timeout {data.timeout_s:.0f} s: {data.why})" if data.why else ""
    return f"hang: no progress for {data.idle_s:.1f} s{timeout}"
