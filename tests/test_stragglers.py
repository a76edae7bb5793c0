"""Straggler scores (core/stragglers.py and its shell, master/pace.py's StragglerWatch): the pod
that consistently ends its steps after its peers is named, across hosts whose clocks differ;
a loaded machine's dips, which delay now one pod and now another, name nobody."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from aegis.core import stragglers
from aegis.core.model import PodName
from aegis.master.pace import StragglerWatch

PERIOD_S = 0.04  # 25 steps/s, as tests/test_slow_node_e2e.py's job
Lateness = Callable[[str, float], float]  # (pod, master time) -> seconds late at the step end


def on_time(pod: str, t: float) -> float:
    return 0.0


def simulate(  # noqa: PLR0913 (one keyword per thing the simulated run varies)
    watch: StragglerWatch,
    pods: int,
    start: float,
    end: float,
    late: Lateness = on_time,
    *,
    seed: int = 1,
    seq: int = 1,
    offsets: dict[str, float] | None = None,
    jitter_s: float = 0.008,
    period_at: Callable[[float], float] = lambda t: PERIOD_S,
) -> list[stragglers.Straggler | None]:
    """A synchronous job of ``pods`` pods stepping every ``period_at(t)`` (``PERIOD_S``; each
    step's length jitters, the same for every pod) from ``start`` to ``end`` (the master's
    clock); pod ``p``
    ends each step ``late(p, t)`` after the job (plus its own small noise), its clock reads
    the master's plus ``offsets[p]``, it beats once a second at its own phase and each beat
    takes 0.5-40 ms to arrive. What the watch named after each beat."""
    rng = random.Random(seed)
    names = [f"j-{i}" for i in range(pods)]
    offsets = offsets or {}
    ends: list[float] = []  # the job's step ends
    t = start
    while t < end + 1.0:
        t += period_at(t) + rng.uniform(-jitter_s, jitter_s)
        ends.append(t)
    beats = sorted(
        (start + n + (i + 0.5) / pods, name)
        for i, name in enumerate(names)
        for n in range(int(end - start))
    )
    named: list[stragglers.Straggler | None] = []
    pod_noise = {name: random.Random(f"{seed}-{name}") for name in names}
    for sent, name in beats:
        # the last step this pod ended by ``sent``
        step = (
            max(k for k, e in enumerate(ends) if e + late(name, e) <= sent) if ends[0] < sent else 0
        )
        step_end = ends[step] + late(name, ends[step]) + pod_noise[name].uniform(0, 0.0005)
        clock = offsets.get(name, 0.0)
        arrival = sent + rng.uniform(0.0005, 0.04)
        watch.step_seen(seq, PodName(name), step, step_end + clock, sent + clock, arrival)
        named.append(watch.named)
    return named


def changing_pace(seed: int) -> Callable[[float], float]:
    """A loaded machine's pace for ``simulate``: 40-ms steps, then 120-ms ones, in spells of 1 to
    5 s (the master's time -> the step period)."""
    edges: list[tuple[float, float]] = []
    spells, t = random.Random(seed), 0.0
    while t < 100.0:
        t += spells.uniform(1.0, 5.0)
        edges.append((t, 0.12 if len(edges) % 2 else PERIOD_S))
    return lambda now: next(p for edge, p in edges if now < edge)


def straggler_from(pod: str, since: float, late_s: float) -> Lateness:
    return lambda p, t: late_s if p == pod and t >= since else 0.0


def settings(**kwargs: float) -> stragglers.StragglerSettings:
    return stragglers.StragglerSettings(window_s=5.0, windows=6, persist=4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("pods", [3, 4, 16])
def test_a_pod_that_ends_its_steps_late_is_named_after_several_windows(pods: int) -> None:
    watch = StragglerWatch(settings())
    late = straggler_from("j-1", 30.0, 0.5 * PERIOD_S)  # half a step late from t=30
    named = simulate(watch, pods, 0.0, 90.0, late)
    beats_before = int(30 * pods) + pods  # up to the beat after t=30
    assert all(n is None for n in named[:beats_before])  # nobody before it turned slow
    assert named[-1] is not None and named[-1].pod == "j-1"
    # not at once: it had to be late in at least 4 windows of 5 s
    first = next(i for i, n in enumerate(named) if n is not None)
    assert first >= (30 + 4 * 5 - 5) * pods, first
    scores = watch.scores()
    # half a step (up to 1.5x that with three pods: see the core's docstring)
    assert 0.35 < scores["j-1"] < (0.9 if pods == 3 else 0.65), scores
    assert all(abs(v) < 0.25 for pod, v in scores.items() if pod != "j-1"), scores
    assert "steps behind its peers, late in" in named[-1].why


def test_long_steps_make_long_enough_windows_to_name_a_straggler() -> None:
    """Steps of 5 s in 5-s windows: a window holds one or two step ends a pod, fewer than
    ``min_samples`` (3), so windows of ``window_s`` alone would judge nobody ever. A window
    lasts ``min_samples`` + 1 step periods instead; the pod half a step late is named, and a
    healthy job of the same pace names nobody."""
    s = settings()
    assert stragglers.window_length_s(s, None) == s.window_s
    assert stragglers.window_length_s(s, PERIOD_S) == s.window_s
    assert stragglers.window_length_s(s, 5.0) == 20.0
    watch = StragglerWatch(s)
    late = straggler_from("j-1", 30.0, 2.5)
    named = simulate(watch, 4, 0.0, 400.0, late, period_at=lambda t: 5.0, jitter_s=0.05)
    assert named[-1] is not None and named[-1].pod == "j-1", list(watch.history)
    assert watch.period is not None and 4.9 < watch.period < 5.1
    healthy = StragglerWatch(s)
    assert set(simulate(healthy, 4, 0.0, 400.0, period_at=lambda t: 5.0, jitter_s=0.05)) == {None}
    assert len(healthy.history) == s.windows  # judged, not silent


def test_clocks_of_different_hosts_need_no_synchronisation() -> None:
    """Each pod's clock is off by up to an hour: the offsets are estimated from the beats
    (the least delayed one), and the straggler is still named, nobody else."""
    offsets = {"j-0": 3600.0, "j-1": -12.5, "j-2": 0.0, "j-3": 7.25}
    watch = StragglerWatch(settings())
    named = simulate(watch, 4, 0.0, 80.0, straggler_from("j-2", 10.0, 0.4 * PERIOD_S),
                     offsets=offsets)  # fmt: skip
    assert named[-1] is not None and named[-1].pod == "j-2"
    healthy = StragglerWatch(settings())
    assert set(simulate(healthy, 4, 0.0, 80.0, offsets=offsets)) == {None}


def test_clock_offset_is_the_least_delayed_beat() -> None:
    beats = [(10.0, 1010.05), (11.0, 1011.001), (12.0, 1012.3)]
    assert stragglers.clock_offset(beats) == pytest.approx(1000.001)


def test_dips_of_a_loaded_machine_that_move_from_pod_to_pod_name_nobody() -> None:
    """A loaded machine holds up now one pod, now another, each for a few seconds, by a whole
    step: every pod is late in some window, none persistently, so none is named."""

    def dips(pod: str, t: float) -> float:
        held = int(t // 7) % 4  # 7-s spells, one pod after the other
        return 1.5 * PERIOD_S if pod == f"j-{held}" else 0.0

    watch = StragglerWatch(settings())
    named = simulate(watch, 4, 0.0, 120.0, dips, jitter_s=0.012)
    assert set(named) == {None}
    assert len(watch.history) == 6  # windows were judged all along


def test_noise_alone_names_nobody_however_many_pods() -> None:
    for pods, seed in ((2, 3), (3, 4), (8, 5), (64, 6)):
        watch = StragglerWatch(settings())
        assert set(simulate(watch, pods, 0.0, 60.0, seed=seed, jitter_s=0.015)) == {None}


@pytest.mark.parametrize("pods", [3, 4, 16])
def test_a_pace_that_changes_from_second_to_second_hides_no_straggler_and_makes_none(
    pods: int,
) -> None:
    """A loaded machine's pace: the job's steps take 40 ms, then 120 ms, in spells of 1 to 5 s
    (3 gloo ranks beside a CPU hog and other test jobs: periods of 60 to 220 ms from one 3-s
    window to the next, benchmarks/RESULTS.md). Each peer is read at its own pace between its
    beats, not at the window's average period: a pod half a step late is named, and nobody is
    in a healthy job."""

    for seed in range(3):
        watch = StragglerWatch(settings())
        named = simulate(watch, pods, 0.0, 90.0, seed=seed, period_at=changing_pace(100 + seed))
        assert set(named) == {None}, (seed, watch.scores())
        assert len(watch.history) == 6  # windows were judged all along
    watch = StragglerWatch(settings())
    late = straggler_from("j-1", 30.0, 0.5 * PERIOD_S)
    named = simulate(watch, pods, 0.0, 90.0, late, period_at=changing_pace(7))
    assert named[-1] is not None and named[-1].pod == "j-1", watch.scores()


def test_a_short_spell_of_lateness_is_not_a_straggler() -> None:
    """Late for two windows (10 s) and then on time: below the persistence of 4 of 6."""
    watch = StragglerWatch(settings())

    def spell(pod: str, t: float) -> float:
        return 0.5 * PERIOD_S if pod == "j-0" and 30 <= t < 40 else 0.0

    named = simulate(watch, 3, 0.0, 90.0, spell)
    assert set(named) == {None}


def test_a_new_round_starts_the_scores_afresh() -> None:
    watch = StragglerWatch(settings())
    simulate(watch, 3, 0.0, 60.0, straggler_from("j-1", 0.0, 0.5 * PERIOD_S))
    assert watch.named is not None
    named = simulate(watch, 3, 100.0, 120.0, seq=3)  # a restart: the round's own scores
    assert watch.seq == 3 and set(named) == {None}
    assert all(abs(v) < 0.25 for v in watch.scores().values())


def test_the_naming_line_and_the_watch_turned_off() -> None:
    watch = StragglerWatch(settings())
    simulate(watch, 3, 0.0, 60.0, straggler_from("j-1", 0.0, 0.5 * PERIOD_S))
    line = watch.naming({PodName("j-1"): "node-1"})
    assert line.startswith("; straggler: node-1 (pod j-1, "), line
    assert StragglerWatch(settings()).naming({}) == ""
    off = StragglerWatch(stragglers.StragglerSettings(window_s=0.0))
    simulate(off, 3, 0.0, 60.0, straggler_from("j-1", 0.0, 0.5 * PERIOD_S))
    assert off.named is None and off.pods == {}


def test_window_and_verdict_tables() -> None:
    """The pure functions on hand-made timelines: lateness in steps against the nearest peer
    samples; one late pod in a window; persistence over windows."""
    period = 0.1
    on = [stragglers.StepEnd(k, k * period) for k in range(0, 100, 10)]
    late = [stragglers.StepEnd(k, k * period + 0.05) for k in range(5, 100, 10)]
    w = stragglers.window({"a": on, "b": list(on), "c": late}, since_s=0.0)
    assert w is not None and w.period_s == pytest.approx(period)
    # c's samples sit between a's and b's: half a step late against them; a and b each have
    # the other and c among their nearest peers (-0.25 raw), and figures are relative to the
    # typical pod's
    assert w.lateness["c"] == pytest.approx(0.75)
    assert w.lateness["a"] == pytest.approx(0.0) and w.lateness["b"] == pytest.approx(0.0)
    s = stragglers.StragglerSettings(windows=3, persist=2, min_late=0.2)
    assert stragglers.late_in(w, s) == "c"
    quiet = stragglers.Window({"a": 0.0, "b": 0.05, "c": 0.1}, period)
    assert stragglers.late_in(quiet, s) is None  # within min_late
    assert stragglers.straggler([w, quiet, quiet], s) is None  # late in 1 of 3
    named = stragglers.straggler([w, quiet, w], s)
    assert named == stragglers.Straggler("c", pytest.approx(0.75), 2, 3)  # type: ignore[arg-type]
    two = stragglers.Window({"a": 0.5, "b": 0.5, "c": -0.5}, period)
    assert stragglers.late_in(two, s) is None  # two late pods: nobody is the straggler
    assert stragglers.window({"a": on}, 0.0) is None  # one pod: no peers
    assert stragglers.window({"a": on[:1], "b": on[:1]}, 0.0) is None  # no period yet


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="persist"):
        stragglers.StragglerSettings(windows=3, persist=4)
    with pytest.raises(ValueError, match="window"):
        stragglers.StragglerSettings(window_s=-1.0)
    with pytest.raises(ValueError, match="min_samples"):
        stragglers.StragglerSettings(min_samples=0)
