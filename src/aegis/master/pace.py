"""The pace watch: notices when a running job's training step rate falls well below the pace it
kept earlier in the same run, so that a node that turned slow (thermal throttling, a degraded
link, a noisy neighbour) is looked for without waiting for a fault.

Synchronous training moves at its slowest rank's pace, so a slow node shows as the whole job
slowing down; which node it is, only a round of checks can tell (allreduce_perf). The watch
follows the job's step (the furthest step any pod's heartbeat reported). Each time it has
advanced and at least ``min_interval_s`` has passed since the last interval closed, the rate
since then is one interval (so heartbeats that arrive together, or late in a batch, do not make
intervals of a few microseconds: each spans about a heartbeat period or more); the job's pace
is the median interval rate over the last ``window_s`` seconds (at least ``min_intervals``
intervals, so long steps get a longer window). The best pace of the round (or the one kept
from the round before, below) is the run's; a pace below ``drop`` times that is a slowdown,
reported once per RunCommand round and at most once per committed checkpoint (a node that is
slow only now and then, or a pace that changes for good, does not start round after round),
and only once the pace has stayed below for ``confirm_s`` (``confirm_windows`` more windows by
default, 3: a loaded machine's dip of a few seconds, as a fresh clone's ``make test`` saw, is
not a slow node; a slow node stays slow).
The report names the straggler when the scores (:class:`StragglerWatch`) name one.

What is not a slowdown: training that stops stepping (the end of the job, a final save: no
advance, no interval; a hang is the hang watchdog's), one long pause such as an evaluation (one
slow interval against the median), a slow start (the best pace is a maximum). Each round (a
restart rewinds the step) measures its own pace, and keeps the best pace of the round before
only when it restarted in place (the same pods on the same nodes) after a round that reported
no slowdown (:func:`carries_best`): a node that turns slow during a restart, or in the first
window after it, is still seen (the chaos soak found one named by nothing for 300 s); a node
that stays slow after a slowdown's round that could not name it does not start round after
round, and a pod moved to another node starts afresh. A new leader goes on from the old one's
notes in the job's record (:class:`PaceNotes`: the round watched, its world and best pace,
whether it reported), so a takeover forgets no pace. Such a round (and the round a new leader
finds running, whose steps it has not heard yet) compares with the kept pace only once its
warm-up is over
(``warm_up_after_s``: ``confirm_after_s``, and at least ``warm_up_s``, 30 s, after its first
step heartbeat): the zygotes of the next warm restart importing torch beside training cut a
2-core machine's pace to a tenth for more than 10 s, which is not a slowdown; a node that stays
slow is reported after it.

:class:`StragglerWatch` is the shell around :mod:`aegis.core.stragglers`: it keeps each pod's
recent step ends (from the heartbeats: the step, its end on the pod's clock, the beat's send time
on the pod's clock) and input times (seconds from a step's end to its next forward), the clock
offsets, and the last windows' figures of both signals; the core decides. Its ``summary`` is
what the job record carries for ``aegis status``.

No I/O and no clock: times are ``time.monotonic()`` values passed in by the job runner.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from aegis.core import stragglers
from aegis.core.model import PodName

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PaceSettings:
    window_s: float = 30.0  # 0 turns the watch off
    drop: float = 0.3  # a pace below this fraction of the run's best pace is a slowdown
    min_intervals: int = 5  # the pace is the median of at least this many advances
    min_interval_s: float = 1.0  # an interval spans at least this long (the heartbeat period)
    # A drop must last this long (None: ``confirm_windows`` more windows) before it is a
    # slowdown: a loaded machine's dip of a few seconds is not a slow node, a slow node stays.
    confirm_s: float | None = None
    confirm_windows: int = 3
    warm_up_s: float = 30.0  # a restart in place's warm-up lasts at least this long

    @property
    def confirm_after_s(self) -> float:
        return self.confirm_windows * self.window_s if self.confirm_s is None else self.confirm_s

    @property
    def warm_up_after_s(self) -> float:
        return max(self.confirm_after_s, self.warm_up_s)

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"the pace window must be >= 0 s, got {self.window_s:g}")
        if not 0 < self.drop < 1:
            raise ValueError(f"the pace drop must be between 0 and 1, got {self.drop:g}")
        if self.min_intervals < 1:
            raise ValueError(f"min_intervals must be >= 1, got {self.min_intervals}")
        if self.min_interval_s <= 0:
            raise ValueError(f"min_interval_s must be > 0, got {self.min_interval_s:g}")
        if self.confirm_s is not None and self.confirm_s < 0:
            raise ValueError(f"confirm_s must be >= 0 s, got {self.confirm_s:g}")
        if self.confirm_windows < 0:
            raise ValueError(f"confirm_windows must be >= 0, got {self.confirm_windows}")
        if self.warm_up_s < 0:
            raise ValueError(f"warm_up_s must be >= 0 s, got {self.warm_up_s:g}")


World = frozenset[tuple[str, str]]  # a round's pods and the node each runs on


def carries_best(before: World | None, after: World | None, reported: bool) -> bool:
    """Whether a new training round keeps the best pace of the round ``before`` it: the pods
    restarted in place (the same pods on the same nodes; None: not known, as for a new master)
    and that round reported no slowdown. After a slowdown the pace is measured afresh (the
    checks found nothing to move, or the slow node leaves at the next commit: then the world
    changes)."""
    return before is not None and before == after and not reported


class PaceNotes(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """What a new leader needs to go on with the pace watch, kept in the job's record
    (``JobNotes.pace``): without it a node that turned slow during the first restart in place
    after a takeover was named by nothing (the round's own pace was its best)."""

    seq: int = -1  # the RunCommand round watched (-1: none yet)
    best: float = 0.0  # its best pace, steps per second (0: not measured yet)
    reported: bool = False  # that round reported a slowdown
    armed: bool = True  # no report since the last committed checkpoint
    world: list[tuple[str, str]] | None = None  # its pods and their nodes (None: not known)


@dataclass(slots=True)
class Pace:
    settings: PaceSettings = field(default_factory=PaceSettings)
    seq: int = -1  # the RunCommand round being watched
    best: float = 0.0  # steps per second: the run's best pace (this round's, or kept)
    reported: bool = False
    armed: bool = True  # no report since the last committed checkpoint
    steps: dict[PodName, int] = field(default_factory=dict)
    started: float | None = None  # the round's first step heartbeat
    last: tuple[float, int] | None = None  # (time, job step) of the last advance
    intervals: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    low_since: float | None = None  # when the pace fell below the drop (and has stayed)
    world: World | None = None  # the round's pods and their nodes (None: not known)
    carried: bool = False  # the best pace is the round before's (a restart in place)

    def step_seen(self, seq: int, pod: PodName, step: int, now: float) -> str | None:
        """A heartbeat of round ``seq`` reported ``pod`` at ``step``: the reason to report a
        slowdown, once per round, else None."""
        s = self.settings
        if s.window_s <= 0:
            return None
        if seq != self.seq:
            self.round_started(seq, None)
        self.steps[pod] = max(step, self.steps.get(pod, step))
        job_step = max(self.steps.values())
        last = self.last
        if last is not None and (job_step <= last[1] or now - last[0] < s.min_interval_s):
            return None  # no advance (or too soon after the last interval): nothing to measure
        self.last = (now, job_step)
        if last is None:
            self.started = now
            return None
        self.intervals.append((now, (job_step - last[1]) / (now - last[0])))
        pace = self._pace(now)
        if pace is None:
            return None
        self.best = max(self.best, pace)
        started = now if self.started is None else self.started
        warming = self.carried and now - started < s.warm_up_after_s
        if pace >= s.drop * self.best or warming:
            self.low_since = None
            return None
        if self.low_since is None:
            self.low_since = now
        if self.reported or not self.armed or now - self.low_since < s.confirm_after_s:
            return None
        self.reported, self.armed = True, False
        return (
            f"{pace:.2f} steps/s over the last {now - self.intervals[0][0]:.0f} s, below "
            f"{s.drop:.0%} of this run's pace of {self.best:.2f} steps/s for "
            f"{now - self.low_since:.0f} s"
        )

    def committed(self) -> None:
        """The job committed a checkpoint: a slowdown may be reported again."""
        self.armed = True

    def round_started(self, seq: int, world: World | None) -> None:
        """Training round ``seq`` runs on ``world`` (None: not known): its own pace is measured
        from now, its best kept from the round before when :func:`carries_best` says so."""
        self.carried = carries_best(self.world, world, self.reported) and self.best > 0
        self.seq, self.reported, self.world = seq, False, world
        self.best = self.best if self.carried else 0.0
        self.started = self.last = self.low_since = None
        self.steps.clear()
        self.intervals.clear()

    def notes(self) -> PaceNotes | None:
        """What the job's record keeps for a new leader (None: nothing to keep)."""
        world = None if self.world is None else sorted(self.world)
        notes = PaceNotes(seq=self.seq, best=self.best, reported=self.reported,
                          armed=self.armed, world=world)  # fmt: skip
        return None if notes == PaceNotes() else notes

    def notes_key(self) -> tuple[object, ...]:
        """What of the notes is worth a record write at once when it changes: a new round, a
        report, a commit, the first pace measured and each quarter better (a pace a little
        better rides on the next write; a warm-up's best is not all a new leader keeps)."""
        grown = math.floor(math.log(self.best, 1.25)) if self.best > 0 else None
        return self.seq, self.world, self.reported, self.armed, grown

    def restore(self, notes: PaceNotes) -> None:
        """A new leader goes on from the old one's ``notes``: a round on the same world keeps
        their best pace; the round running now compares with it after the warm-up (the new
        leader has heard none of its steps yet). A best pace that is no rate is ignored."""
        if not (math.isfinite(notes.best) and notes.best >= 0):
            log.warning("the pace notes' best pace %r is no rate: measured afresh", notes.best)
            return
        self.seq, self.best, self.reported, self.armed = (
            notes.seq, notes.best, notes.reported, notes.armed)  # fmt: skip
        self.world = None if notes.world is None else frozenset(notes.world)
        self.carried = self.best > 0

    def _pace(self, now: float) -> float | None:
        """The median rate of the window's intervals: None until a full window is seen."""
        s, intervals = self.settings, self.intervals
        while len(intervals) > s.min_intervals and intervals[0][0] < now - s.window_s:
            intervals.popleft()
        assert self.started is not None
        if len(intervals) < s.min_intervals or now - self.started < s.window_s:
            return None
        return statistics.median(rate for _, rate in intervals)


OFFSET_BEATS = 60  # the clock offset is the least delayed of this many recent beats
KEPT_WINDOWS = 2  # step ends are kept this many windows (a window compares with the one before)


@dataclass(slots=True)
class _PodSteps:
    beats: collections.deque[tuple[float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=OFFSET_BEATS)
    )  # (sent on the pod's clock, arrived on the master's)
    ends: collections.deque[tuple[int, float, float]] = field(default_factory=collections.deque)
    # (step, its end on the pod's clock, when it arrived on the master's)
    inputs: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    # (the input time in seconds, when it arrived on the master's): one per new step


@dataclass(slots=True)
class StragglerWatch:
    """Straggler scores during training (:mod:`aegis.core.stragglers` decides)."""

    settings: stragglers.StragglerSettings = field(default_factory=stragglers.StragglerSettings)
    seq: int = -1
    pods: dict[PodName, _PodSteps] = field(default_factory=dict)
    window_start: float | None = None
    history: collections.deque[stragglers.Window] = field(default_factory=collections.deque)
    # the input times' windows (a rank slow before the collective)
    input_history: collections.deque[stragglers.Window] = field(default_factory=collections.deque)
    named: stragglers.Straggler | None = None  # the straggler, as of the last window
    period: float | None = None  # the last window's step period (long steps: longer windows)
    # for the job record (``aegis status``): {"scores": {pod: score}, "named": pod, "why": ...},
    # a new dict at each window; ``named_changed`` until the job runner took the change
    summary: dict[str, Any] = field(default_factory=dict)
    named_changed: bool = False

    def step_seen(
        self,
        seq: int,
        pod: PodName,
        step: int,
        step_ts: float,
        sent: float,
        now: float,
        input_s: float | None = None,
    ) -> None:
        """A heartbeat of round ``seq``: ``pod`` ended ``step`` at ``step_ts`` and sent the beat
        at ``sent`` (both on its own clock), its last input time ``input_s`` (None: not
        measured); ``now`` on the master's."""
        s = self.settings
        if s.window_s <= 0:
            return
        if seq != self.seq:
            self.seq, self.window_start, self.period = seq, None, None
            self._name(None)
            self.summary = {}
            self.pods.clear()
            self.history.clear()
            self.input_history.clear()
        steps = self.pods.setdefault(pod, _PodSteps())
        steps.beats.append((sent, now))
        ends = steps.ends
        if ends and step < ends[-1][0]:
            ends.clear()  # rewound within a round (not expected): start this pod afresh
        if not ends or step > ends[-1][0]:
            ends.append((step, step_ts, now))
            if input_s is not None:
                steps.inputs.append((input_s, now))
        length = stragglers.window_length_s(s, self.period)
        while ends and ends[0][2] < now - KEPT_WINDOWS * length:
            ends.popleft()
        inputs = steps.inputs
        while inputs and inputs[0][1] < now - KEPT_WINDOWS * length:
            inputs.popleft()
        if self.window_start is None:
            self.window_start = now
        elif now - self.window_start >= length:
            self._close_window(now)

    def _close_window(self, now: float) -> None:
        s, since = self.settings, self.window_start
        assert since is not None
        timelines = {}
        for pod, steps in self.pods.items():
            offset = stragglers.clock_offset(steps.beats)
            timelines[str(pod)] = [stragglers.StepEnd(k, ts + offset) for k, ts, _ in steps.ends]
        window = stragglers.window(timelines, since, s.min_samples)
        self.window_start = now
        period = window.period_s if window is not None else stragglers.period_s(timelines)
        self.period = period if period is not None else self.period
        inputs = {
            str(pod): [v for v, arrived in steps.inputs if arrived >= since]
            for pod, steps in self.pods.items()
        }
        inputs_window = (
            None if period is None else stragglers.input_window(inputs, period, s.min_samples)
        )
        for history, new in ((self.history, window), (self.input_history, inputs_window)):
            if new is not None:
                history.append(new)
            while len(history) > s.windows:
                history.popleft()
        self._name(
            stragglers.straggler(tuple(self.history), s)
            or stragglers.straggler(tuple(self.input_history), s, "input")
        )
        named = self.named
        self.summary = {
            "scores": {pod: round(v, 3) for pod, v in sorted(self.scores().items())},
            "named": "" if named is None else named.pod,
            "why": "" if named is None else named.why,
        }

    def _name(self, named: stragglers.Straggler | None) -> None:
        before = None if self.named is None else self.named.pod
        self.named_changed |= before != (None if named is None else named.pod)
        self.named = named

    def take_named_change(self) -> bool:
        """Whether the pod named (or nobody) changed since the last call."""
        changed, self.named_changed = self.named_changed, False
        return changed

    def scores(self) -> Mapping[str, float]:
        """Each pod's score over the windows kept: steps behind its peers at the step end plus
        steps later than they into its forward."""
        return stragglers.combined(tuple(self.history), tuple(self.input_history))

    def end_scores(self) -> Mapping[str, float]:
        """The step ends' part of :meth:`scores` alone."""
        return stragglers.scores(tuple(self.history))

    def naming(self, nodes: Mapping[PodName, str]) -> str:
        """ "; straggler: <node> (pod P, why)" when the scores name one, else ""."""
        named = self.named
        if named is None:
            return ""
        node = nodes.get(PodName(named.pod), "?")
        return f"; straggler: {node} (pod {named.pod}, {named.why})"
