"""The pace watch (pure): a run that falls well below its own pace is reported once per round;
noise, warm-up, long steps and new rounds are not slowdowns."""

from __future__ import annotations

import pytest

from aegis.core.model import PodName
from aegis.master.pace import Pace, PaceSettings

PODS = (PodName("j-0"), PodName("j-1"), PodName("j-2"))


def beat(pace: Pace, seq: int, start: float, end: float, rate: float, step0: int) -> list[str]:
    """Every pod reports the job's step once a second from ``start`` to ``end`` at ``rate``
    steps per second from ``step0``; the reasons the watch gave."""
    reasons = []
    t = start
    while t <= end + 1e-9:
        for pod in PODS:
            step = step0 + int(rate * (t - start))
            reason = pace.step_seen(seq, pod, step, t)
            if reason is not None:
                reasons.append(reason)
        t += 1.0
    return reasons


def test_a_run_that_slows_to_a_fifth_is_reported_once() -> None:
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    assert beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0) == []
    assert pace.best == pytest.approx(30.0, rel=0.05)
    reasons = beat(pace, 3, 21.0, 40.0, rate=6.0, step0=600)
    assert len(reasons) == 1
    assert "below 30% of this run's pace of 30" in reasons[0]


def test_noise_and_a_slow_start_are_not_slowdowns() -> None:
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    assert beat(pace, 3, 0.0, 10.0, rate=5.0, step0=0) == []  # warm-up: slow, then faster
    assert beat(pace, 3, 11.0, 30.0, rate=30.0, step0=50) == []
    assert beat(pace, 3, 31.0, 45.0, rate=15.0, step0=620) == []  # half the pace: not enough


def test_a_new_round_measures_its_own_pace() -> None:
    """After a restart (new seq) the run's pace is measured again: a node that stays slow
    after a round that did not name it does not start round after round."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0)
    assert len(beat(pace, 3, 21.0, 40.0, rate=6.0, step0=600)) == 1
    assert beat(pace, 5, 50.0, 90.0, rate=6.0, step0=400) == []
    assert pace.best == pytest.approx(6.0, rel=0.1)


def test_long_steps_get_a_window_of_enough_intervals() -> None:
    """Steps of 4 s and a 5-s window: the pace is the median of at least min_intervals
    advances, so the step's quantisation is no slowdown, and a real drop is still found."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3, min_intervals=5))
    assert beat(pace, 1, 0.0, 400.0, rate=0.25, step0=0) == []
    assert pace.best == pytest.approx(0.25, rel=0.01)
    assert len(beat(pace, 1, 401.0, 800.0, rate=0.025, step0=101)) == 1


def test_the_end_of_training_and_an_evaluation_pause_are_not_slowdowns() -> None:
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    beat(pace, 2, 0.0, 20.0, rate=30.0, step0=0)
    assert beat(pace, 2, 21.0, 60.0, rate=0.0, step0=600) == []  # stopped stepping (a hang
    # is the hang watchdog's): no advance, nothing measured
    assert beat(pace, 2, 61.0, 80.0, rate=30.0, step0=601) == []  # one long pause, then on


def test_the_watch_can_be_turned_off_and_refuses_bad_settings() -> None:
    pace = Pace(PaceSettings(window_s=0.0))
    beat(pace, 1, 0.0, 20.0, rate=30.0, step0=0)
    assert beat(pace, 1, 21.0, 60.0, rate=1.0, step0=600) == []
    with pytest.raises(ValueError, match="drop"):
        PaceSettings(drop=1.5)
    with pytest.raises(ValueError, match="window"):
        PaceSettings(window_s=-1)
    with pytest.raises(ValueError, match="min_intervals"):
        PaceSettings(min_intervals=0)


def delivered(
    pace: Pace, pods: int, start: float, end: float, rate: float, batch_s: float
) -> list[str]:
    """``pods`` pods beat once a second at staggered offsets, the job stepping at ``rate``; the
    master receives the heartbeats in batches every ``batch_s`` (all of a batch at once)."""
    beats = []
    for index in range(pods):
        t = start + index / pods
        while t <= end:
            beats.append((t, PodName(f"j-{index}"), int(rate * t)))
            t += 1.0
    reasons = []
    for position, (sent, pod, step) in enumerate(sorted(beats)):
        # a batch is handled back to back, microseconds apart
        arrival = (int(sent / batch_s) + 1) * batch_s + position * 1e-6
        reason = pace.step_seen(1, pod, step, arrival)
        if reason is not None:
            reasons.append(reason)
    return reasons


@pytest.mark.parametrize(("pods", "batch_s"), [(4, 0.25), (64, 0.25), (3, 0.5), (64, 1.0)])
def test_heartbeats_arriving_together_neither_inflate_the_pace_nor_report(
    pods: int, batch_s: float
) -> None:
    pace = Pace(PaceSettings(window_s=30.0, drop=0.3))
    assert delivered(pace, pods, 0.0, 120.0, rate=20.0, batch_s=batch_s) == []
    assert pace.best == pytest.approx(20.0, rel=0.3)
    # and a real slowdown to a tenth is still seen through the same delivery
    slowed = Pace(PaceSettings(window_s=30.0, drop=0.3))
    delivered(slowed, pods, 0.0, 60.0, rate=20.0, batch_s=batch_s)
    beats = [
        (60.0 + k + i / pods, PodName(f"j-{i}"), 1200 + int(2.0 * (k + i / pods)))
        for k in range(150)  # the drop lasts longer than its confirmation, three windows
        for i in range(pods)
    ]
    reasons = [
        r
        for n, (t, pod, step) in enumerate(sorted(beats))
        if (r := slowed.step_seen(1, pod, step, (int(t / batch_s) + 1) * batch_s + n * 1e-6))
        is not None
    ]
    assert len(reasons) == 1


def test_one_report_per_committed_checkpoint() -> None:
    """A node slow only now and then: after a round that found nothing, training restarts
    (a new round) and the watch waits for a committed checkpoint before it reports again."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0)
    assert len(beat(pace, 3, 21.0, 40.0, rate=6.0, step0=600)) == 1
    beat(pace, 5, 50.0, 70.0, rate=30.0, step0=400)
    assert beat(pace, 5, 71.0, 90.0, rate=6.0, step0=1000) == []  # no commit since
    pace.committed()
    beat(pace, 7, 100.0, 120.0, rate=30.0, step0=400)
    assert len(beat(pace, 7, 121.0, 140.0, rate=6.0, step0=1000)) == 1


def test_a_dip_shorter_than_a_window_is_no_slowdown_and_one_that_stays_is() -> None:
    """The probe of issue 18: a loaded machine halved the pace for a few seconds before the
    injected node turned slow, and that was reported. A drop must now last three more windows
    (``confirm_windows``)."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.5))
    assert pace.settings.confirm_after_s == 15.0
    assert beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0) == []
    # 5 s at a sixth of the pace: the median of the 5-s window stays low for a few seconds
    assert beat(pace, 3, 21.0, 25.0, rate=5.0, step0=600) == []
    assert beat(pace, 3, 26.0, 50.0, rate=30.0, step0=625) == []  # back: nothing reported
    assert pace.low_since is None
    # two whole windows at a sixth (a longer spell of load) are not enough either
    assert beat(pace, 3, 51.0, 60.0, rate=5.0, step0=1345) == []
    assert beat(pace, 3, 61.0, 90.0, rate=30.0, step0=1395) == []
    assert pace.low_since is None
    reasons = beat(pace, 3, 91.0, 120.0, rate=5.0, step0=2265)  # slow for good
    assert len(reasons) == 1 and "for 15 s" in reasons[0], reasons


def test_the_confirmation_can_be_set_in_windows_or_seconds() -> None:
    assert PaceSettings(window_s=4.0, confirm_windows=1).confirm_after_s == 4.0
    assert PaceSettings(window_s=4.0, confirm_s=2.5).confirm_after_s == 2.5
    with pytest.raises(ValueError, match="confirm_windows"):
        PaceSettings(confirm_windows=-1)
