"""Straggler scores (pure): which pod is consistently the last to finish its training steps.

The signal. Every rank writes its step and the ``time.monotonic()`` of the step's end into its
pod's progress file; the agent sends the last pair with each heartbeat, with its own
``time.monotonic()`` at the moment it sent it. Clocks of different hosts are not compared
directly: the master estimates each pod's clock offset the way NTP does, as the least
``arrival - sent`` over recent heartbeats (the least delayed beat; queueing on a loaded machine
only ever adds), and so places every pod's step ends on its own clock. Pods of one host share
their monotonic clock, so there the offsets are all the same and only the transit time is left.

Lateness. In synchronous training every rank ends step k at about the same time. A pod's
lateness at a step it was sampled at is its step end minus the median of its peers' ends of the
same step (the peers with the nearest samples on either side, at most ``neighbours`` in all;
each peer's end of that step read between its own samples around it, at its own pace there, or
at the step period past its first or last sample: a window costs O(samples log samples) however
many pods), in units of the step period (so it means the same at 100 steps/s and at one step a
minute). Beats come once a second, so a peer's sample is steps away from the pod's: a period
averaged over the window, applied across those steps, would read a loaded machine's pace
changing from one second to the next as lateness. A window of ``window_s`` seconds
gives each pod one figure: the median of its samples in the window, less the median of all
pods' figures (with few pods a straggler's samples also serve as its peers' references, which
this takes out for the healthy pods; with three pods the straggler's figure reads up to 1.5x).

Decision (robust statistics over several windows). In a window a pod is *late* when its figure
exceeds its peers' median by more than ``min_late`` steps and by more than ``z`` robust
deviations (1.4826 x MAD) of its peers' figures. A pod is named a straggler only when it was
late in at least ``persist`` of the last ``windows`` windows, and it is the only such pod
(three pods at least: two pods' figures mirror each other): a loaded machine's dip delays
whichever rank the scheduler happens to hold up, now one, now another, and is no straggler.
``min_late`` is a quarter of a step: on a machine loaded to six times its cores the scheduler
alone kept one healthy rank about 0.2 steps behind for several 3-s windows.
A figure is the median of the pod's samples in its window, at most one a heartbeat and one a
step. With short steps a window wants about ten (``window_s`` of ten heartbeats, as the
defaults give): under a 2-core busy loop, with steps of 65 ms, a single step end was up to
several steps off, and the median of three put a healthy rank 0.3 to 0.8 steps behind in
about one 3-s window in six; the median of twelve, never more than 0.16. With long steps a
window holds fewer (one a step), but a scheduler's delay is then a small part of a step; a
window lasts at least ``min_samples`` + 1 step periods (:func:`window_length_s`), or a job
with steps longer than a third of ``window_s`` would never get a figure.
The score exported per node is the median of the pod's figures over those windows.

What this signal sees and what it does not: it sees a rank that ends its steps after its peers,
that is, one that is slow *between* the collective and the end of the step (the optimizer step,
work done after it). A rank that is slow *before* the collective makes the others wait inside
the collective, and all ranks then end the step together: step ends cannot see it.

The input time, a second signal for that one. Each rank also reports the seconds from a step's
end to its next forward (:mod:`aegis.autoprogress`: data loading, preprocessing, whatever it does
before the forward), a span on one clock (no offsets). A rank slow there begins its forward
late, and its peers wait for it in the collective: their input times stay short. Per window each
pod's figure is the median of its input times, in step periods, less the median pod's
(:func:`input_window`); the same rule (:func:`late_in`, :func:`straggler`) judges those
windows, and a pod's score is the sum of its two (:func:`combined`): steps late at the step end
plus steps late into its forward. What neither sees: a rank slow in its own forward or backward
compute (it enters the collective late, but neither the start nor the end of its step differs
from its peers'): the pace watch and allreduce_perf find that one.

No I/O, no clock: times are passed in.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAD_SCALE = 1.4826  # MAD x this estimates the standard deviation of normal data


@dataclass(frozen=True, slots=True)
class StragglerSettings:
    window_s: float = 10.0  # one figure per pod per window; 0 turns the scores off
    windows: int = 6  # the last this many windows are judged
    persist: int = 4  # late in at least this many of them to be named
    min_late: float = 0.25  # steps: later than this behind the peers' median, ...
    z: float = 3.0  # ... and than this many robust deviations of the peers' figures
    min_samples: int = 3  # a pod's figure in a window needs this many samples

    def __post_init__(self) -> None:
        if self.window_s < 0:
            raise ValueError(f"the straggler window must be >= 0 s, got {self.window_s:g}")
        if self.windows < 1 or not 1 <= self.persist <= self.windows:
            raise ValueError(
                f"need 1 <= persist <= windows, got persist {self.persist} of {self.windows}"
            )
        if self.min_late < 0 or self.z < 0:
            raise ValueError("min_late and z must be >= 0")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")


@dataclass(frozen=True, slots=True)
class StepEnd:
    """Pod ``step`` ended at ``end_s`` (the master's clock)."""

    step: int
    end_s: float


@dataclass(frozen=True, slots=True)
class Window:
    """One window's figures: pod -> lateness in steps; the step period seen."""

    lateness: Mapping[str, float]
    period_s: float


@dataclass(frozen=True, slots=True)
class Straggler:
    pod: str
    score: float  # steps late: the median of its figures over the windows judged
    late_windows: int
    windows: int
    signal: str = "end"  # which signal named it: "end" (step ends) or "input" (input times)

    @property
    def why(self) -> str:
        behind = "behind its peers" if self.signal == "end" else "later into its forward"
        return (
            f"{self.score:.2f} steps {behind}, late in {self.late_windows} of the "
            f"last {self.windows} windows"
        )


def window_length_s(settings: StragglerSettings, period: float | None) -> float:
    """How long a window lasts: ``window_s``, or with long steps (``period`` s; None: not known
    yet) ``min_samples`` + 1 step periods, so that every pod can end ``min_samples`` steps in
    it (a window holds at most one sample a step) with one to spare."""
    if period is None or period <= 0:
        return settings.window_s
    return max(settings.window_s, (settings.min_samples + 1) * period)


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """The median and the median absolute deviation of ``values`` (not empty)."""
    median = statistics.median(values)
    return median, statistics.median(abs(v - median) for v in values)


def clock_offset(beats: Sequence[tuple[float, float]]) -> float:
    """The offset to add to a pod's clock to read the master's, from (sent on the pod's clock,
    arrived on the master's) pairs: the least delayed beat's difference."""
    return min(arrived - sent for sent, arrived in beats)


def period_s(timelines: Mapping[str, Sequence[StepEnd]]) -> float | None:
    """The step period: the median over pods of (time / steps) between their first and last
    sample; None before any pod advanced."""
    rates = [
        (t[-1].end_s - t[0].end_s) / (t[-1].step - t[0].step)
        for t in timelines.values()
        if len(t) >= 2 and t[-1].step > t[0].step
    ]
    return statistics.median(rates) if rates else None


def _reference(
    pooled: Sequence[tuple[int, float, str]],
    own: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    pod: str,
    step: int,
    period: float,
    neighbours: int,
) -> float | None:
    """When the peers of ``pod`` ended ``step``: the median, over the peers with samples
    nearest in step (``pooled`` sorted by step; on each side the nearest sample of each peer,
    ``neighbours`` // 2 peers a side at most), of each one's own end of ``step`` (``own``:
    each pod's steps and ends, in step order). A peer with samples on both sides of ``step`` is
    interpolated between them, at its own pace over that stretch: a loaded machine's pace
    changes from one second to the next, and a period averaged over the window, applied across
    the steps between a beat of one pod and a beat of another, reads that change as lateness.
    A peer with samples on one side only is moved to ``step`` at the step period."""
    i = bisect.bisect_left(pooled, (step, -math.inf, ""))
    peers: set[str] = set()
    for indexes in (range(i - 1, -1, -1), range(i, len(pooled))):
        side: set[str] = set()
        for j in indexes:
            other = pooled[j][2]
            if other == pod or other in side:
                continue
            side.add(other)
            if len(side) >= max(neighbours // 2, 1):
                break
        peers |= side
    found = [_at(step, *own[peer], period) for peer in peers]
    return statistics.median(found) if found else None


def _at(step: int, steps: Sequence[int], ends: Sequence[float], period: float) -> float:
    """A pod's end of ``step`` from its samples (``steps`` ascending, not empty)."""
    j = bisect.bisect_left(steps, step)
    if 0 < j < len(steps):  # steps[j - 1] < step <= steps[j]
        k0, k1 = steps[j - 1], steps[j]
        return ends[j - 1] + (step - k0) * (ends[j] - ends[j - 1]) / (k1 - k0)
    nearest = min(j, len(steps) - 1)
    return ends[nearest] + (step - steps[nearest]) * period


def window(
    timelines: Mapping[str, Sequence[StepEnd]],
    since_s: float,
    min_samples: int = 1,
    neighbours: int = 8,
) -> Window | None:
    """Each pod's lateness over its samples that ended at or after ``since_s``, against the
    peer samples nearest in step (any pod's, ``neighbours`` of them, so a window costs
    O(samples log samples) however many pods); None with fewer than two pods with a figure or
    before the step period is known. A pod with fewer than ``min_samples`` samples has none."""
    if len(timelines) < 2:
        return None
    period = period_s(timelines)
    if period is None or period <= 0:
        return None
    pooled = sorted((s.step, s.end_s, pod) for pod, t in timelines.items() for s in t)
    own = {
        pod: ([s.step for s in ordered], [s.end_s for s in ordered])
        for pod, t in timelines.items()
        for ordered in [sorted(t, key=lambda s: (s.step, s.end_s))]
    }
    lateness: dict[str, float] = {}
    for pod, timeline in timelines.items():
        mine: list[float] = []
        for sample in timeline:
            if sample.end_s < since_s:
                continue
            reference = _reference(pooled, own, pod, sample.step, period, neighbours)
            if reference is not None:
                mine.append((sample.end_s - reference) / period)
        if len(mine) >= min_samples:
            lateness[pod] = statistics.median(mine)
    if len(lateness) < 2:
        return None
    # relative to the typical pod: a straggler's own samples among its peers' references move
    # theirs (with 3 pods, the median of 2 peers is their mean), not the median of all figures
    typical = statistics.median(lateness.values())
    return Window({pod: v - typical for pod, v in lateness.items()}, period)


def input_window(
    inputs: Mapping[str, Sequence[float]], period: float, min_samples: int = 1
) -> Window | None:
    """Each pod's input time (the median of its samples in seconds, less the median pod's), in
    step periods of ``period`` s; None with fewer than two pods with ``min_samples`` samples
    or without a period."""
    if period <= 0:
        return None
    figures = {
        pod: statistics.median(samples) / period
        for pod, samples in inputs.items()
        if len(samples) >= min_samples
    }
    if len(figures) < 2:
        return None
    typical = statistics.median(figures.values())
    return Window({pod: v - typical for pod, v in figures.items()}, period)


def late_in(w: Window, settings: StragglerSettings) -> str | None:
    """The pod late in window ``w``, if exactly one is: later than its peers' median by more
    than ``min_late`` steps and ``z`` robust deviations of the peers' figures. Nobody with
    fewer than three pods: two pods' figures are each other's mirror, with no peers' spread to
    tell noise from a straggler."""
    if len(w.lateness) < 3:
        return None
    late = []
    for pod, mine in w.lateness.items():
        peers = [v for other, v in w.lateness.items() if other != pod]
        median, mad = median_mad(peers)
        if mine - median > max(settings.min_late, settings.z * MAD_SCALE * mad):
            late.append(pod)
    return late[0] if len(late) == 1 else None


def scores(history: Sequence[Window]) -> dict[str, float]:
    """Each pod's score: the median of its figures over ``history``."""
    figures: dict[str, list[float]] = {}
    for w in history:
        for pod, value in w.lateness.items():
            figures.setdefault(pod, []).append(value)
    return {pod: statistics.median(values) for pod, values in figures.items()}


def combined(*histories: Sequence[Window]) -> dict[str, float]:
    """Each pod's score over several signals' histories: the sum of its scores in each."""
    total: dict[str, float] = {}
    for history in histories:
        for pod, score in scores(history).items():
            total[pod] = total.get(pod, 0.0) + score
    return total


def straggler(
    history: Sequence[Window], settings: StragglerSettings, signal: str = "end"
) -> Straggler | None:
    """The pod late in at least ``persist`` of the last ``windows`` windows, if there is one
    (``signal`` names the history's signal in its verdict)."""
    recent = history[-settings.windows :]
    counts: dict[str, int] = {}
    for w in recent:
        pod = late_in(w, settings)
        if pod is not None:
            counts[pod] = counts.get(pod, 0) + 1
    named = [pod for pod, count in counts.items() if count >= settings.persist]
    if len(named) != 1:
        return None
    pod = named[0]
    return Straggler(pod, scores(recent)[pod], counts[pod], len(recent), signal)
