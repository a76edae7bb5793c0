"""A job's checkpoints as safe points, for the job runner: the step every pod has committed,
the training step rate (from heartbeats), and checkpoint requests on behalf of drains and slow
pods, with the drain deadlines.

The job is committed at a step when every pod has committed it; each new committed step becomes
one ``CheckpointCommitted`` event for the core. A request is made once per RunCommand round while
a pod waits to leave at a checkpoint (drain always; slow when configured): every rank saves at a
step it reaches only after the request has arrived (``target_step``), so a request waits for this
round's first reported steps (a target of "the next call" is not one step for all: a rank whose
agent gets the order late has already passed it). A drain stops waiting
(``DrainForced``) when its deadline passes.
When a pod's script says it takes no requests, a slow pod leaves at the script's first own save
after it said so (``torch.save``, a distributed checkpoint: the agent's ``ScriptSavedData``,
sent once the training has gone past the save), once per round; a script that saves nothing of
its own keeps it waiting. A drain waits for that save too, or for the job's next periodic
commit, when the save cadence puts it before the drain's deadline (``save_due``: the interval
between two saves, or from the start of training to the first, kept across restarts), and stops
waiting once it is overdue; otherwise it stops waiting at once and resumes from the last
periodic checkpoint. A save is overdue only when training has also gone the cadence's steps
past the last one (``late_save_comes``): a pause (an evaluation, a slow spell) delays a save that
comes every N steps, and the drain then waits for it when, at the pace of training, it comes
before the drain's deadline.
Times are ``time.monotonic()`` values passed in by the caller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aegis.core import events as ev
from aegis.core.model import JobStatus, PodName
from aegis.core.phases import Phase
from aegis.wire import messages as m
from aegis.wire.logsafe import one_line

log = logging.getLogger(__name__)

KEPT_STEPS = 16  # committed steps remembered per pod
RATE_GAP_S = 0.5  # heartbeats closer than this make no step-rate sample (an early one, a save)
DECLINE_CHARS = 200  # what of a pod's reason for declining a request is kept


def save_due(
    last: float | None, interval: float | None, margin: float, slack_s: float
) -> float | None:
    """When the next save should have been reported by: ``last`` (the last save's report, or
    the start of this run of training) plus ``margin`` intervals, and at least ``slack_s`` past
    one interval (a loaded node's jitter on a short one); None while either is unknown."""
    if last is None or interval is None:
        return None
    return last + max(margin * interval, interval + slack_s)


@dataclass(frozen=True, slots=True)
class StepCadence:
    """Where training is against the script's save cadence in steps."""

    furthest: int | None  # the furthest step heard (None: none yet since a takeover; -1: none)
    last: int  # the step of the last save, or of the start of training (-1: neither)
    steps: int | None  # between two saves (None: not known yet)
    rate: float  # training steps per second (0: not known)


def late_save_comes(
    cadence: StepCadence, margin: float, slack_s: float, now: float, end: float
) -> bool:
    """Whether a save late by the clock is still to come before ``end`` (the first deadline of
    the draining pods): training has not gone ``margin`` intervals of steps past the last save
    (it paused, an evaluation, or slowed), and at its pace it reaches the next save's step with
    the spare ``save_due`` gives (``margin`` - 1 intervals, at least ``slack_s``) before ``end``.
    A new leader that has heard no step yet waits for one. False while the step cadence is
    unknown, or when the steps heard lie below the last save (another numbering)."""
    c = cadence
    if c.steps is None or c.last < 0:
        return False
    if c.furthest is None:
        return now < end
    if not c.last <= c.furthest < c.last + margin * c.steps:
        return False
    if c.rate <= 0:
        return now + slack_s < end
    left_s = max(c.last + c.steps - c.furthest, 0) / c.rate
    return now + left_s + max((margin - 1) * c.steps / c.rate, slack_s) < end


@dataclass(frozen=True, slots=True)
class RequestSettings:
    on_slow: bool = True  # a pod marked slow leaves at the next step boundary, not periodic
    lead_s: float = 2.0  # the requested step lies this far ahead of the estimate
    hold_s: float = 30.0  # ranks hold after saving, at most this long
    # a request waits this long for the round's reported steps (its target lies ahead of them);
    # a script that reports none then gets one due at its next call
    progress_wait_s: float = 10.0
    # a drain of a script that takes no requests waits for its next save (its own, or the
    # job's periodic commit) when that is due before the drain's deadline: due this many
    # intervals after the last one, and at least the slack past one interval (jitter)
    save_margin: float = 1.5
    save_slack_s: float = 2.0


@dataclass(slots=True)
class SafePoints:
    job: str
    settings: RequestSettings = field(default_factory=RequestSettings)
    committed_step: int = -1
    # the steps each pod committed (its newest KEPT_STEPS): the job is committed at a step only
    # when every pod has that very step (ranks that saved a late request at different steps
    # have no common one: the newest of each is not a step all can load)
    pod_steps: dict[PodName, set[int]] = field(default_factory=dict)
    rewound_seq: int = -1  # the round training last restarted in, from the committed step
    steps: dict[PodName, tuple[int, float]] = field(default_factory=dict)  # this round's
    rate_from: dict[PodName, tuple[int, float]] = field(default_factory=dict)  # a sample's start
    step_rate: float = 0.0  # training steps per second, smoothed
    request_seq: int = -1  # the RunCommand round a checkpoint was requested in
    drain_deadlines: dict[PodName, tuple[float, float]] = field(default_factory=dict)
    declined_seq: int = -1
    # (round, the newest own save of the script then) when a slow pod's script declined
    script_wait: tuple[int, int] | None = None
    script_saves: dict[PodName, tuple[int, int]] = field(default_factory=dict)  # (round, step)
    script_taken: int = -1  # the round a script's own save was taken as the commit in
    # the save cadence (the script's own saves and the job's commits; one save told both ways
    # counts once, by its step): the interval between two saves, kept across restarts (it is
    # the script's), first measured from the start of training; and when the last save of this
    # run of training was reported, or the run started (its first step heard)
    save_interval: float | None = None
    save_last: float | None = None
    cadence_step: int = -1  # the step of the last save of this run (-1: none yet)
    # the same cadence in steps (a pause delays a save the script makes every N steps): the
    # steps between two saves, and the first step heard of this run of training
    save_steps: int | None = None
    start_step: int = -1
    start_heard: bool = True  # save_last from a heartbeat is a start (not a new leader's look)
    drain_waits: int = -1  # the round a drain waits for the next save in
    late_told: int = -1  # the round a drain was told to wait on for a save late by the clock
    due_since: tuple[int, float] = (-1, 0.0)  # (round, when) a request first waited for steps

    def committed(
        self, status: JobStatus, pod: PodName, step: int, now: float, seq: int = -1
    ) -> int | None:
        """``pod`` committed ``step``, said in round ``seq``: the job's new committed step (the
        newest step every pod committed), or None if unchanged. A new one is a save of the
        job's cadence too (a drain of a script that takes no requests waits for the next
        periodic one when it is due in time, as for the script's own saves). A report said
        before the last rewind of a step past the committed one is of the abandoned timeline
        (sent before the restart, heard after it): it counts for nothing."""
        if 0 <= seq < self.rewound_seq and step > self.committed_step:
            log.info("job %s: %s's commit of step %d, said in round %d, is of the timeline the "
                     "restart of round %d abandoned: not counted", self.job, pod, step, seq,
                     self.rewound_seq)  # fmt: skip
            return None
        steps = self.pod_steps.setdefault(pod, set())
        steps.add(step)
        if len(steps) > KEPT_STEPS:
            steps.discard(min(steps))
        common = set.intersection(*(self.pod_steps.get(p, set()) for p in status.pod_infos))
        committed = max(common, default=-1)
        if committed <= self.committed_step:
            return None
        self.committed_step = committed
        self._saved_at(committed, now)
        return committed

    def rewound(self, seq: int = -1) -> None:
        """Training (re)starts from the job's committed step in round ``seq``: what a pod
        committed beyond it belongs to an abandoned timeline and counts again only when
        committed anew (and said in that round or later: ``committed``); the steps
        seen before are no estimate of where it is (extrapolated across a long troubleshoot
        round they named a step past the end of the job, and a slow pod waited for the next
        periodic checkpoint instead of the requested one)."""
        self.rewound_seq = seq
        self.pod_steps = {
            p: {s for s in steps if s <= self.committed_step} for p, steps in self.pod_steps.items()
        }
        self.steps.clear()
        self.rate_from.clear()
        # the next save comes about one interval after the restart's first step
        self.save_last, self.cadence_step, self.start_heard = None, -1, True
        self.start_step = -1

    def resume_step(self) -> int | None:
        """The step every rank resumes from (``AEGIS_RESUME_STEP``): the committed step; 0 (a
        fresh start) when pods committed steps but none in common, so that no rank resumes from
        a step the others do not have; None when nothing was committed (each rank its own)."""
        if self.committed_step >= 0:
            return self.committed_step
        return 0 if any(self.pod_steps.values()) else None

    def step_seen(self, status: JobStatus, pod: PodName, seq: int, step: int, now: float) -> None:
        """A heartbeat's training step (of the current round only: a restart rewinds)."""
        if seq != status.seq:
            return
        if self.save_last is None:  # the first step of this run of training
            self.save_last, self.start_step = now, step
        self.steps[pod] = (step, now)
        before = self.rate_from.setdefault(pod, (step, now))
        gap = now - before[1]
        if gap <= 0 or (gap < RATE_GAP_S and self.step_rate > 0):
            return  # once a rate is known, heartbeats close together add up to one sample
        self.rate_from[pod] = (step, now)
        if step > before[0]:
            rate = (step - before[0]) / (now - before[1])
            self.step_rate = rate if self.step_rate == 0 else 0.7 * self.step_rate + 0.3 * rate

    def target_step(self, now: float) -> int:
        """A step every rank reaches only after the request has arrived: the furthest rank's
        estimated step now, plus the lead time's worth of steps, plus one."""
        rate = self.step_rate
        current = [step + rate * (now - ts) for step, ts in self.steps.values()]
        if not current:
            return 0  # no progress reported: save at the next call
        return int(max(current) + rate * self.settings.lead_s) + 1

    def request(self, status: JobStatus, now: float) -> dict[str, str] | None:
        """The environment of a checkpoint order, once per RunCommand round, when a pod waits
        to leave at a checkpoint; None when none is due (or it waits for the round's steps)."""
        if not self.due(status) or not self._placeable(status.seq, now):
            return None
        self.request_seq = status.seq
        env = {
            m.CKPT_REQUEST_ENV: str(status.seq),
            m.CKPT_STEP_ENV: str(self.target_step(now)),
            m.CKPT_HOLD_ENV: f"{self.settings.hold_s:g}",
        }
        log.info("job %s: checkpoint requested at step %s", self.job, env[m.CKPT_STEP_ENV])
        return env

    def due(self, status: JobStatus) -> bool:
        """Whether this round's request is still to be made: a pod waits to leave at a
        checkpoint (drain always; slow when configured) and none was ordered in this round."""
        if status.phase is not Phase.RUN_COMMAND or self.request_seq == status.seq:
            return False
        slow = self.settings.on_slow and status.slow_count > 0
        return status.drain_count > 0 or slow

    def _placeable(self, seq: int, now: float) -> bool:
        """Whether a target step can be placed ahead of every rank: this round's steps and the
        step rate are known, or the request has waited ``progress_wait_s`` for them."""
        if self.steps and self.step_rate > 0:
            return True
        if self.due_since[0] != seq:
            self.due_since = (seq, now)
        if now - self.due_since[1] < self.settings.progress_wait_s:
            return False
        log.warning("job %s: no pace of this round's training in %g s: the checkpoint "
                    "request is due at each rank's next call", self.job,
                    self.settings.progress_wait_s)  # fmt: skip
        return True

    def drain(self, pods: tuple[PodName, ...], deadline_s: float, now: float) -> None:
        for pod in pods:
            self.drain_deadlines[pod] = (now + deadline_s, deadline_s)

    def taken_over(self, status: JobStatus, requested: bool, deadline_s: float, now: float) -> None:
        """A new leader: a full drain deadline from now (``safe_point_notes.restore`` then
        puts back the old leader's, when its record kept them); a request already ordered in
        this round is not made again."""
        for pod, info in status.pod_infos.items():
            if info.drain:
                self.drain_deadlines[pod] = (now + deadline_s, deadline_s)
        if requested:
            self.request_seq = status.seq
        self.start_heard = False  # its first heartbeat is somewhere between two saves

    def declined(
        self, status: JobStatus, pod: PodName, reason: str, now: float
    ) -> ev.DrainForced | None:
        """A pod's script takes no requests: a slow pod waits for the script's next own save
        (or the next periodic checkpoint); a drain waits for that save too when it is due
        before the drain's deadline, else stops waiting and uses the last periodic
        checkpoint. ``reason``, a pod's words, is logged and carried by a forced drain into
        every draining pod's record: one line of at most DECLINE_CHARS."""
        reason = one_line(reason, DECLINE_CHARS)
        draining = tuple(p for p, info in status.pod_infos.items() if info.drain)
        can_wait = self.script_taken != status.seq
        waits = can_wait and bool(draining) and self._save_before_deadline(draining, now)
        waiting = self.script_wait is not None and self.script_wait[0] == status.seq
        if (status.slow_count > 0 or waits) and can_wait and not waiting:
            self.script_wait = (status.seq, self._newest_save(status.seq))
            log.warning("job %s: %s: %s; a pod waiting for a checkpoint leaves at the script's "
                        "next own save", self.job, pod, reason)  # fmt: skip
        if not draining or self.declined_seq == status.seq:
            return None
        self.declined_seq = status.seq
        if waits:
            self.drain_waits = status.seq
            return None
        return self._forced(draining, f"{pod}: {reason}")

    def script_saved(
        self, status: JobStatus, pod: PodName, seq: int, step: int | None, now: float
    ) -> int | None:
        """A report of round ``seq``: ``pod``'s script saved at ``step`` on its own, and trains
        beyond it. The step to take as committed (slow and drained pods leave) when it is the
        script's first own save since it declined a request in this round; else None. A step
        the pod's heartbeats have not gone past this round (or below 0) is not believed."""
        beyond = self.steps.get(pod, (-1, 0.0))[0]
        if step is None or seq != status.seq or not 0 <= step < beyond:
            return None
        self.script_saves[pod] = (seq, step)
        self._saved_at(step, now)
        wait = self.script_wait
        leaving = status.slow_count + status.drain_count
        if wait is None or wait[0] != seq or step <= wait[1] or leaving == 0:
            return None
        self.script_wait, self.script_taken = None, seq
        log.warning("job %s: %s's script saved at step %d: the pods waiting for a checkpoint "
                    "leave", self.job, pod, step)  # fmt: skip
        return step

    def _save_before_deadline(self, draining: tuple[PodName, ...], now: float) -> bool:
        """Whether the next save (the script's own, or a periodic commit) is due (``save_due``)
        before the deadline of every draining pod (and not overdue already: a save late by the
        clock while training pauses is still to come)."""
        due, end = self._save_due(), self._first_deadline(draining, now)
        if due is None:
            return False
        return due < end if now <= due else self._late_save_comes(now, end)

    def _saved_at(self, step: int, now: float) -> None:
        """A save at ``step`` was reported at ``now``: a new one of the cadence when it is newer
        than the last (every rank may report the same save, a DCP save to aegis' store comes
        both as the script's own and as a commit)."""
        if step <= self.cadence_step:
            return
        last, from_start = self.save_last, self.cadence_step < 0
        # two saves of one run; or the start and the first save, while no interval is known
        measured = not from_start or (self.start_heard and self.save_interval is None)
        if last is not None and now > last and measured:
            self.save_interval = now - last
        base = self.cadence_step if not from_start else self.start_step
        if (not from_start or (self.start_heard and self.save_steps is None)) and 0 <= base < step:
            self.save_steps = step - base
        self.save_last, self.cadence_step = now, step

    def _newest_save(self, seq: int) -> int:
        return max((step for s, step in self.script_saves.values() if s == seq), default=-1)

    def _first_deadline(self, draining: tuple[PodName, ...], now: float) -> float:
        return min(self.drain_deadlines.get(p, (now, 0.0))[0] for p in draining)

    def _late_save_comes(self, now: float, end: float) -> bool:
        heard = max((step for step, _ in self.steps.values()), default=None)
        cadence = StepCadence(
            furthest=heard if heard is not None or self.start_step >= 0 else -1,
            last=self.cadence_step if self.cadence_step >= 0 else self.start_step,
            steps=self.save_steps,
            rate=self.step_rate,
        )
        s = self.settings
        return late_save_comes(cadence, s.save_margin, s.save_slack_s, now, end)

    def _save_due(self) -> float | None:
        s = self.settings
        return save_due(self.save_last, self.save_interval, s.save_margin, s.save_slack_s)

    def deadlines_passed(self, status: JobStatus, now: float) -> list[ev.DrainForced]:
        """The drains that stop waiting now: their deadline passed, or the save they wait for
        (the script takes no requests) is overdue (late by the clock and the steps: the script
        stopped saving)."""
        forced = self._save_overdue(status, now)
        for pod in [p for p, (t, _) in self.drain_deadlines.items() if now >= t]:
            _, seconds = self.drain_deadlines.pop(pod)
            info = status.pod_infos.get(pod)
            if info is None or not info.drain:
                continue
            why = f"no checkpoint committed within the drain deadline of {seconds:g} s"
            log.warning("job %s: drain of %s: %s; evicting anyway", self.job, pod, why)
            forced.append(ev.DrainForced((pod,), why))
        return forced

    def _save_overdue(self, status: JobStatus, now: float) -> list[ev.DrainForced]:
        draining = tuple(p for p, info in status.pod_infos.items() if info.drain)
        due = self._save_due()
        if self.drain_waits != status.seq or not draining or (due is not None and now <= due):
            return []
        if self._late_save_comes(now, self._first_deadline(draining, now)):
            if self.late_told != status.seq:
                self.late_told = status.seq
                log.warning("job %s: the next save is late, but training has not gone the save "
                            "cadence's steps past the last (it paused or slowed): the drain "
                            "waits on for it", self.job)  # fmt: skip
            return []
        self.drain_waits = -1
        return [self._forced(draining, "the next save, due by now, has not come")]

    def _forced(self, draining: tuple[PodName, ...], cause: str) -> ev.DrainForced:
        """The drain of ``draining`` stops waiting for a save: they resume from the last
        periodic checkpoint."""
        last = f"step {self.committed_step}" if self.committed_step >= 0 else "none yet"
        why = f"{cause}; resuming from the last periodic checkpoint ({last})"
        log.warning("job %s: drain of %s: %s", self.job, ", ".join(draining), why)
        return ev.DrainForced(draining, why)
