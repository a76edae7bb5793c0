"""The pace watch (pure): a run that falls well below its own pace is reported once per round;
noise, warm-up, long steps and new rounds on other nodes are not slowdowns; a restart in place
keeps the pace of the round before."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from aegis.core.model import PodName
from aegis.core.phases import Phase
from aegis.master.pace import Pace, PaceNotes, PaceSettings

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


NODES = frozenset((str(pod), f"node-{i}") for i, pod in enumerate(PODS))


def test_a_node_slow_from_a_restart_in_place_is_seen_against_the_pace_before_it() -> None:
    """The chaos soak's gap: a node that turned slow during a restart set the new round's best
    pace itself, and nothing named it. A restart in place (the same pods on the same nodes,
    after a round that reported nothing) keeps the best pace of the round before."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    assert pace.settings.warm_up_after_s == 30.0  # the warm-up's floor (confirmation: 15 s)
    pace.round_started(3, NODES)
    assert beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0) == []
    pace.round_started(5, NODES)  # a crash restarted every pod in place
    reasons = beat(pace, 5, 30.0, 100.0, rate=6.0, step0=400)  # slow from the round's start
    assert len(reasons) == 1 and "pace of 30" in reasons[0] and "for 15 s" in reasons[0]
    # without the round before's pace (its world not known) the round's own is the best
    fresh = Pace(PaceSettings(window_s=5.0, drop=0.3))
    beat(fresh, 3, 0.0, 20.0, rate=30.0, step0=0)
    assert beat(fresh, 5, 30.0, 100.0, rate=6.0, step0=400) == []


def test_a_restarts_warm_up_is_no_slowdown() -> None:
    """After a restart in place the zygotes of the next warm restart import torch beside
    training (a tenth of the pace for more than 10 s on a 2-core machine): the kept pace is
    compared with only ``warm_up_after_s`` after the round's first step heartbeat (its
    confirmation, and at least 30 s), so a warm-up that outlasts a window and its confirmation
    is no slowdown."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3, warm_up_s=0.0))
    assert pace.settings.warm_up_after_s == 15.0
    pace.round_started(3, NODES)
    beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0)
    pace.round_started(5, NODES)
    assert beat(pace, 5, 30.0, 52.0, rate=3.0, step0=400) == []  # 22 s at a tenth
    assert beat(pace, 5, 53.0, 100.0, rate=30.0, step0=466) == []
    # short windows (the chaos soak's 3 s) still leave a restart 30 s to warm up in
    short = Pace(PaceSettings(window_s=3.0, drop=0.6))
    short.round_started(3, NODES)
    beat(short, 3, 0.0, 20.0, rate=30.0, step0=0)
    short.round_started(5, NODES)
    assert beat(short, 5, 30.0, 57.0, rate=3.0, step0=400) == []  # 27 s at a tenth
    assert beat(short, 5, 58.0, 100.0, rate=30.0, step0=481) == []
    assert pace.low_since is None


@pytest.mark.parametrize(
    ("world", "why"),
    [
        (NODES - {(str(PODS[2]), "node-2")} | {(str(PODS[2]), "node-9")}, "a pod moved"),
        (NODES - {(str(PODS[2]), "node-2")}, "a pod fewer"),
        (None, "not known"),
    ],
)
def test_a_round_on_other_nodes_measures_its_own_pace(
    world: frozenset[tuple[str, str]] | None, why: str
) -> None:
    """A world of other nodes (a pod moved off a bad node, the job shrank) may keep another
    pace: its best is measured afresh."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    pace.round_started(3, NODES)
    beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0)
    pace.round_started(5, world)
    assert pace.best == 0.0, why
    assert beat(pace, 5, 30.0, 60.0, rate=6.0, step0=400) == [], why


def test_after_a_slowdowns_round_in_place_the_pace_is_measured_afresh() -> None:
    """A slowdown's round that moved nobody (the checks named no node): the round after, on the
    same nodes, does not report the same slowness again."""
    pace = Pace(PaceSettings(window_s=5.0, drop=0.3))
    pace.round_started(3, NODES)
    beat(pace, 3, 0.0, 20.0, rate=30.0, step0=0)
    assert len(beat(pace, 3, 21.0, 40.0, rate=6.0, step0=600)) == 1
    pace.committed()
    pace.round_started(5, NODES)
    assert beat(pace, 5, 50.0, 90.0, rate=6.0, step0=400) == []
    assert pace.best == pytest.approx(6.0, rel=0.1)
    pace.round_started(7, NODES)  # and a crash's restart after it keeps that pace
    assert pace.best == pytest.approx(6.0, rel=0.1)


def test_the_master_keeps_the_pace_over_a_crashs_restart_in_place_and_not_over_a_move() -> None:
    """``Progress`` gives the pace watch each round's world from the job's status: a crash's
    restart in place keeps the pace (the node that turned slow meanwhile is reported), a round
    after a pod moved to another node does not."""
    from aegis.core import events as ev
    from aegis.core.model import NodeName
    from aegis.master.job_settings import JobSettings
    from aegis.master.progress import Progress
    from aegis.wire import messages as m
    from tests.core_helpers import Driver

    job = Driver(workers=3, max_retry=10)
    job.to_running()
    progress = Progress("job", JobSettings(pace=PaceSettings(window_s=5.0, drop=0.3)))

    def run(start: float, end: float, rate: float) -> list[str]:
        reasons, t = [], start
        while t <= end:
            for pod in job.pods:
                beat = m.HeartbeatData(step=int(rate * (t - start)))
                stepped = progress.step_seen(job.status, pod, job.status.seq, beat, t)
                reasons += [] if stepped.slowdown is None else [stepped.slowdown]
            t += 1.0
        return reasons

    assert run(0.0, 20.0, rate=30.0) == []
    seq = job.status.seq
    job.feed(ev.PodErrored(job.pod(1), job.status.phase, seq, "ValueError: bad sample", "", 10))
    job.answer_all()  # the checks find every node healthy: training restarts in place
    assert job.status.phase is Phase.RUN_COMMAND and job.status.seq > seq
    assert len(run(30.0, 80.0, rate=6.0)) == 1
    progress.pace.committed()  # (a report again allowed)
    # the same again after a move: the pod of rank 2 now runs on another node
    moved = dict(job.status.pod_infos)
    moved[job.pod(2)] = dataclasses.replace(moved[job.pod(2)], node=NodeName("node-9"))
    job.status = dataclasses.replace(job.status, pod_infos=moved, seq=job.status.seq + 1)
    assert run(90.0, 110.0, rate=30.0) == []
    assert not progress.pace.carried
    moved[job.pod(2)] = dataclasses.replace(moved[job.pod(2)], node=NodeName("node-2"))
    job.status = dataclasses.replace(job.status, pod_infos=moved, seq=job.status.seq + 1)
    assert run(120.0, 190.0, rate=6.0) == []  # (back on node-2: another world again)
    assert not progress.pace.carried


def _new_leader(old: Pace, settings: PaceSettings) -> Pace:
    """A new leader's watch, restored from the old one's notes as the job's record carries
    them (JSON)."""
    notes = old.notes()
    assert notes is not None
    pace = Pace(settings)
    pace.restore(msgspec.json.decode(msgspec.json.encode(notes), type=PaceNotes))
    return pace


def test_a_new_leader_keeps_the_old_ones_pace_over_a_restart_in_place() -> None:
    """The old leader measured round 3's pace on NODES and died; a crash then restarted every
    pod in place, and a node turned slow at it: the new leader reports it against round 3's
    pace (before, it knew no round before, and the slow round's own pace was its best)."""
    settings = PaceSettings(window_s=5.0, drop=0.3)
    old = Pace(settings)
    old.round_started(3, NODES)
    beat(old, 3, 0.0, 20.0, rate=30.0, step0=0)
    pace = _new_leader(old, settings)
    assert (pace.seq, pace.world, pace.best) == (3, NODES, old.best)
    pace.round_started(5, NODES)
    reasons = beat(pace, 5, 30.0, 100.0, rate=6.0, step0=400)
    assert len(reasons) == 1 and "pace of 30" in reasons[0]
    # a new leader without notes (the record of an older master) measures afresh, as before
    fresh = Pace(settings)
    fresh.round_started(5, NODES)
    assert beat(fresh, 5, 30.0, 100.0, rate=6.0, step0=400) == []


def test_a_new_leader_goes_on_watching_the_round_it_finds_running() -> None:
    """The round the old leader watched still runs: the new leader, which has heard none of its
    steps, compares with the old one's pace after the warm-up; a dip while it starts hearing
    (22 s at a tenth) is no slowdown, a node that stays slow is."""
    settings = PaceSettings(window_s=5.0, drop=0.3)
    old = Pace(settings)
    old.round_started(3, NODES)
    beat(old, 3, 0.0, 20.0, rate=30.0, step0=0)
    pace = _new_leader(old, settings)
    assert beat(pace, 3, 25.0, 47.0, rate=3.0, step0=700) == []
    assert beat(pace, 3, 48.0, 70.0, rate=30.0, step0=766) == []
    assert len(beat(pace, 3, 71.0, 130.0, rate=6.0, step0=1456)) == 1


@pytest.mark.parametrize(
    ("world", "reported", "why"),
    [
        (NODES - {(str(PODS[2]), "node-2")} | {(str(PODS[2]), "node-9")}, False, "a pod moved"),
        (NODES, True, "the old leader's round reported a slowdown"),
    ],
)
def test_a_new_leader_measures_afresh_where_the_old_one_would_have(
    world: frozenset[tuple[str, str]], reported: bool, why: str
) -> None:
    settings = PaceSettings(window_s=5.0, drop=0.3)
    old = Pace(settings)
    old.round_started(3, NODES)
    beat(old, 3, 0.0, 20.0, rate=30.0, step0=0)
    if reported:
        assert len(beat(old, 3, 21.0, 40.0, rate=6.0, step0=600)) == 1
    pace = _new_leader(old, settings)
    assert pace.reported is reported and pace.armed is not reported
    pace.round_started(5, world)
    assert pace.best == 0.0, why
    assert beat(pace, 5, 50.0, 90.0, rate=6.0, step0=400) == [], why


def test_notes_with_no_rate_are_ignored_and_a_watch_with_nothing_has_no_notes() -> None:
    assert Pace().notes() is None
    pace = Pace()
    grown = Pace(best=10.0)
    key = grown.notes_key()
    grown.best = 11.0  # a little better: rides on the next write
    assert grown.notes_key() == key
    grown.best = 13.0  # a quarter better: written at once
    assert grown.notes_key() != key
    for best in (-2.0, float("nan"), float("inf")):
        pace.restore(PaceNotes(seq=3, best=best, world=[("j-0", "node-0")]))
        assert (pace.seq, pace.best, pace.world, pace.carried) == (-1, 0.0, None, False)


async def test_a_record_with_pace_notes_is_adopted_and_written_back() -> None:
    """The notes in the store reach the new leader's pace watch, and the record it writes at
    the takeover keeps them; a record without them (an older master's) starts afresh."""
    import json

    from aegis.adapters import memory
    from aegis.master import job_builder, job_record, records
    from aegis.master.job_settings import JobSettings
    from aegis.master.ports import NullPlatform
    from tests.test_job_record import OLD_RECORD

    world = [["up-0", "node-0"], ["up-1", "node-1"]]
    for notes in ({"seq": 2, "best": 12.5, "world": world}, None):
        raw = json.loads(OLD_RECORD) | ({} if notes is None else {"pace": notes})
        store, bus = memory.MemoryStore(), memory.MemoryBus()
        revision = await store.put("default.up", json.dumps(raw).encode(), expected_revision=None)
        record, _, _ = records.decode_record(json.dumps(raw).encode())
        builder = job_builder.JobBuilder(bus, store, JobSettings(heartbeat_timeout_s=60))
        runner = builder.adopt(record, revision, NullPlatform(), None, epoch=4,
                               fence=lambda: None)  # fmt: skip
        await runner.takeover()
        got = await store.get("default.up")
        assert got is not None
        written = job_record.decode(got[0]).pace
        await runner.unsubscribe()
        if notes is None:
            assert written is None
            continue
        assert written == PaceNotes(seq=2, best=12.5, world=[("up-0", "node-0"),
                                                             ("up-1", "node-1")])  # fmt: skip
        pace = runner.progress.pace
        assert (pace.seq, pace.best, pace.carried) == (2, 12.5, True)


def test_the_record_is_written_at_once_for_a_new_round_a_pace_and_a_report() -> None:
    """The pace's notes move a record write for a new round, the first pace measured and a
    report, not for each heartbeat (a better pace rides on the next write)."""
    from aegis.master.job_record import JobNotes
    from aegis.master.job_settings import JobSettings
    from aegis.master.progress import Progress
    from aegis.wire import messages as m
    from tests.core_helpers import Driver

    job = Driver(workers=3)
    job.to_running()
    progress = Progress("job", JobSettings(pace=PaceSettings(window_s=5.0, drop=0.3)))
    written = JobNotes()
    progress.note(written, 0.0, 1000.0)
    moved_at = []
    for t in range(60):
        rate = 30 if t < 20 else 6
        for pod in job.pods:
            beat_ = m.HeartbeatData(step=rate * t if t < 20 else 600 + rate * (t - 20))
            progress.step_seen(job.status, pod, job.status.seq, beat_, float(t))
            if progress.notes_moved():
                moved_at.append(t)
                progress.note(written, float(t), 1000.0 + t)
    assert len(moved_at) == 3, moved_at  # the round, its first pace, the report
    assert written.pace is not None and written.pace.reported
    assert written.pace.best == pytest.approx(30.0, rel=0.1)
