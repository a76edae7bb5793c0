"""The job runner's safe points alone: committed steps, step rate, checkpoint requests, and when
a drain stops waiting."""

from __future__ import annotations

import pytest

from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.master.safe_points import RequestSettings, SafePoints, save_due
from aegis.wire import messages as m
from tests.core_helpers import Driver


def running(drain: int | None = None) -> Driver:
    job = Driver(workers=3)
    job.to_running()
    if drain is not None:
        job.feed(ev.DrainRequested((job.pod(drain),), "maintenance"))
    return job


def test_the_job_is_committed_at_the_newest_step_every_pod_committed_once_per_step() -> None:
    job, safe = running(), SafePoints("job")
    a, b, c = job.pods
    for pod in (a, b):
        assert safe.committed(job.status, pod, 5, 0.0) is None
        assert safe.committed(job.status, pod, 10, 0.0) is None
    assert safe.committed(job.status, c, 5, 0.0) == 5
    assert safe.committed(job.status, c, 10, 0.0) == 10
    assert safe.committed(job.status, c, 10, 0.0) is None  # the same step again
    assert safe.committed(job.status, a, 8, 0.0) is None  # an older step changes nothing
    assert safe.committed_step == 10 and safe.resume_step() == 10


def test_ranks_that_saved_at_different_steps_have_no_common_step_and_restart_together() -> None:
    """A checkpoint request seen late: ranks a and b saved at 27, c at 26. The newest step of
    each is not a step every rank can load: nothing is committed, and a restart starts every
    rank afresh (AEGIS_RESUME_STEP 0) rather than c from 26 and the others from nothing."""
    job, safe = running(), SafePoints("job")
    a, b, c = job.pods
    assert safe.resume_step() is None  # nothing committed by anyone: each rank its own
    for pod, step in ((a, 27), (b, 27), (c, 26)):
        assert safe.committed(job.status, pod, step, 0.0) is None
    assert safe.committed_step == -1 and safe.resume_step() == 0
    assert safe.committed(job.status, c, 28, 0.0) is None
    assert safe.committed(job.status, a, 28, 0.0) is None
    assert safe.committed(job.status, b, 28, 0.0) == 28  # a step all have, later


def test_after_a_rewind_a_step_a_pod_committed_before_counts_only_when_committed_again() -> None:
    """Rank a committed 6 before the restart; the job had 4. Training restarts from 4: a's
    old 6 belongs to the abandoned timeline, so b's 6 alone does not commit the job."""
    job, safe = running(), SafePoints("job")
    a, b, c = job.pods
    for pod, step in ((a, 4), (a, 6), (b, 4), (c, 4)):
        safe.committed(job.status, pod, step, 0.0)
    assert safe.committed_step == 4
    safe.rewound()
    assert safe.committed(job.status, b, 6, 0.0) is None
    assert safe.committed(job.status, c, 6, 0.0) is None  # a has not committed its new 6 yet
    assert safe.committed(job.status, a, 6, 0.0) == 6


def test_target_step_lies_ahead_of_the_furthest_rank_by_the_lead_time() -> None:
    job, safe = running(), SafePoints("job", RequestSettings(lead_s=1.0))
    a, b, _ = job.pods
    assert safe.target_step(now=0.0) == 0  # no progress yet: the next call saves
    seq = job.status.seq
    safe.step_seen(job.status, a, seq, 100, now=10.0)
    safe.step_seen(job.status, a, seq, 110, now=11.0)  # 10 steps/s
    safe.step_seen(job.status, b, seq, 105, now=11.0)
    safe.step_seen(job.status, b, seq - 1, 999, now=11.0)  # an older round's: ignored
    assert safe.step_rate == 10.0
    assert safe.target_step(now=12.0) == 110 + 10 + 10 + 1  # now + lead + 1


def test_a_request_is_made_once_per_round_while_a_pod_drains() -> None:
    job, safe = running(), SafePoints("job", RequestSettings(lead_s=1.0, hold_s=5.0))
    seq = job.status.seq
    safe.step_seen(job.status, job.pod(0), seq, 40, now=0.0)
    safe.step_seen(job.status, job.pod(0), seq, 50, now=1.0)  # 10 steps/s
    assert safe.request(job.status, now=1.0) is None  # nobody waits to leave
    job.feed(ev.DrainRequested((job.pod(1),), "maintenance"))
    env = safe.request(job.status, now=1.0)
    assert env == {m.CKPT_REQUEST_ENV: str(job.status.seq), m.CKPT_STEP_ENV: "61",
                   m.CKPT_HOLD_ENV: "5"}  # fmt: skip
    assert safe.request(job.status, now=2.0) is None  # once per round


def test_a_request_waits_for_the_rounds_pace_then_falls_back_to_the_next_call() -> None:
    """No step (or no rate) known, no step lies surely ahead of every rank: the request waits
    for heartbeats with steps; a script that reports none gets one due at its next call after
    ``progress_wait_s``, once."""
    job, safe = running(drain=1), SafePoints("job", RequestSettings(progress_wait_s=10.0))
    assert safe.request(job.status, now=100.0) is None
    safe.step_seen(job.status, job.pod(0), job.status.seq, 7, now=105.0)  # one beat: no rate
    assert safe.request(job.status, now=109.9) is None
    env = safe.request(job.status, now=110.0)
    assert env is not None and env[m.CKPT_STEP_ENV] == "8"  # what is known: the step after
    assert safe.request(job.status, now=200.0) is None
    job.feed(ev.DrainRequested((job.pod(2),), "maintenance"))
    fresh = SafePoints("job", RequestSettings(progress_wait_s=10.0))
    assert fresh.request(job.status, now=0.0) is None
    assert fresh.request(job.status, now=10.0) == {
        m.CKPT_REQUEST_ENV: str(job.status.seq),
        m.CKPT_STEP_ENV: "0",
        m.CKPT_HOLD_ENV: "30",
    }


def test_a_request_waits_for_run_command() -> None:
    job, safe = Driver(workers=3), SafePoints("job")
    job.ack_all()
    job.feed(ev.DrainRequested((job.pod(0),), "maintenance"))
    assert job.status.phase is Phase.BOOT_CHECKING and job.status.drain_count == 1
    assert safe.request(job.status, now=0.0) is None


def test_a_declining_script_forces_the_drain_once_per_round() -> None:
    job, safe = running(drain=2), SafePoints("job")
    forced = safe.declined(job.status, job.pod(0), "no requests taken", 0.0)
    assert forced is not None and forced.pods == (job.pod(2),)
    assert "last periodic checkpoint (none yet)" in forced.reason
    assert safe.declined(job.status, job.pod(1), "no requests taken", 0.0) is None
    assert SafePoints("job").declined(running().status, job.pod(0), "x", 0.0) is None  # no drain


def test_a_drain_deadline_forces_only_a_pod_still_draining() -> None:
    job, safe = running(drain=1), SafePoints("job")
    safe.drain((job.pod(1), job.pod(2)), deadline_s=5.0, now=100.0)
    assert safe.deadlines_passed(job.status, now=104.9) == []
    forced = safe.deadlines_passed(job.status, now=105.0)
    assert [f.pods for f in forced] == [(job.pod(1),)]  # pod 2 never drained
    assert "deadline of 5 s" in forced[0].reason
    assert safe.deadlines_passed(job.status, now=200.0) == []  # each deadline once


def test_a_new_leader_restarts_the_deadlines_and_keeps_the_rounds_request() -> None:
    job, safe = running(drain=0), SafePoints("job")
    safe.taken_over(job.status, requested=True, deadline_s=60.0, now=10.0)
    assert safe.drain_deadlines == {job.pod(0): (70.0, 60.0)}
    assert safe.request(job.status, now=11.0) is None  # already ordered in this round


def test_the_next_own_save_is_due_a_margin_of_intervals_after_the_last() -> None:
    assert save_due(None, 10.0, 1.5, 2.0) is None and save_due(20.0, None, 1.5, 2.0) is None
    assert save_due(20.0, 10.0, 1.5, 2.0) == 35.0
    assert save_due(11.0, 1.0, 1.5, 2.0) == 14.0  # a short interval: the slack past it


def _draining_with_saves(*times: float) -> tuple[Driver, SafePoints]:
    """Pod 2 drains (deadline 60 s from t=100); pod 0's script saved on its own at steps 20,
    40, ... reported at ``times``."""
    job, safe = running(drain=2), SafePoints("job")
    safe.drain((job.pod(2),), deadline_s=60.0, now=100.0)
    safe.step_seen(job.status, job.pod(0), job.status.seq, 1000, 100.0)
    for k, t in enumerate(times):
        assert safe.script_saved(job.status, job.pod(0), job.status.seq, 20 * (k + 1), t) is None
    return job, safe


def test_a_drain_waits_for_the_scripts_own_save_due_before_its_deadline() -> None:
    job, safe = _draining_with_saves(90.0, 100.0)  # every 10 s: the next one due by 115
    assert safe.declined(job.status, job.pod(0), "no requests taken", 101.0) is None
    assert safe.declined(job.status, job.pod(1), "no requests taken", 102.0) is None  # once
    seq = job.status.seq
    assert safe.script_saved(job.status, job.pod(1), seq, 40, 105.0) is None  # known already
    assert safe.script_saved(job.status, job.pod(0), seq, 60, 110.0) == 60  # the commit
    assert safe.script_saved(job.status, job.pod(0), seq, 80, 120.0) is None  # once a round
    actions = job.feed(ev.CheckpointCommitted(60))
    assert job.status.drain_count == 0 and job.status.recover_count == 0
    assert [type(a).__name__ for a in actions].count("EvictPod") == 1


def test_a_drain_stops_waiting_at_once_when_the_scripts_save_is_not_due_in_time() -> None:
    cases = {
        "no save yet: no cadence": (),
        "due after the deadline": (50.0, 100.0),  # every 50 s: due by 175, the deadline 160
        "overdue already": (80.0, 90.0),  # due by 105: late at 110
    }
    for case, times in cases.items():
        job, safe = _draining_with_saves(*times)
        forced = safe.declined(job.status, job.pod(0), "no requests taken", 110.0)
        assert forced is not None and forced.pods == (job.pod(2),), case
        assert "last periodic checkpoint" in forced.reason, case
    job, safe = _draining_with_saves(90.0, 100.0)
    safe.drain_deadlines.clear()  # a drain with no deadline known: nothing bounds a wait
    assert safe.declined(job.status, job.pod(0), "no requests taken", 101.0) is not None


def test_a_save_not_yet_late_but_due_after_the_deadline_is_not_waited_for() -> None:
    """The step rule is for a save late by the clock: a save due (by the clock) after the
    drain's deadline is not waited for, however few steps training has made since the last."""
    job, safe = running(drain=2), SafePoints("job")
    seq = job.status.seq
    safe.drain((job.pod(2),), deadline_s=60.0, now=100.0)
    for step, t in ((20, 50.0), (40, 100.0)):  # every 50 s: the next one due by 175
        safe.step_seen(job.status, job.pod(0), seq, step + 1, t)
        safe.script_saved(job.status, job.pod(0), seq, step, t)
    safe.step_seen(job.status, job.pod(0), seq, 45, 110.0)
    forced = safe.declined(job.status, job.pod(0), "no requests taken", 110.0)
    assert forced is not None and "last periodic checkpoint" in forced.reason


def test_a_waiting_drain_stops_when_the_save_it_waits_for_is_overdue() -> None:
    job, safe = _draining_with_saves(90.0, 100.0)  # due by 115, the deadline 160
    assert safe.declined(job.status, job.pod(0), "no requests taken", 101.0) is None
    assert safe.deadlines_passed(job.status, now=115.0) == []
    [forced] = safe.deadlines_passed(job.status, now=115.1)
    assert (
        forced.pods == (job.pod(2),) and "the next save, due by now, has not come" in forced.reason
    )
    assert safe.deadlines_passed(job.status, now=116.0) == []  # once


def _paused_drain(heard: int, at: float = 101.0) -> tuple[Driver, SafePoints]:
    """Pod 0's script saves every 100 steps (10 s), the last at step 300 (t=100); training is
    heard at step ``heard`` at ``at``, when pod 2 drains (deadline 60 s) and the script takes no
    requests: the drain waits for the save at 400, due by t=115."""
    job, safe = running(drain=2), SafePoints("job")
    seq = job.status.seq
    safe.step_seen(job.status, job.pod(0), seq, 100, 70.0)  # training starts
    for step, t in ((200, 90.0), (300, 100.0)):
        safe.step_seen(job.status, job.pod(0), seq, step + 1, t)
        assert safe.script_saved(job.status, job.pod(0), seq, step, t) is None
    assert (safe.save_interval, safe.save_steps) == (10.0, 100)
    safe.step_seen(job.status, job.pod(0), seq, heard, at)
    safe.drain((job.pod(2),), deadline_s=60.0, now=at)
    assert safe.declined(job.status, job.pod(0), "no requests taken", at) is None  # waits
    return job, safe


def test_a_pause_in_training_does_not_make_the_save_overdue() -> None:
    """An evaluation stops training at step 340: the save at 400 is late by the clock, but not
    by the steps (it is not 1.5 intervals of steps past 300): the drain waits on, then leaves
    at that save."""
    job, safe = _paused_drain(heard=340)
    seq = job.status.seq
    assert safe.deadlines_passed(job.status, now=130.0) == []  # 15 s past due
    safe.step_seen(job.status, job.pod(0), seq, 401, 140.0)  # training goes on after the pause
    assert safe.script_saved(job.status, job.pod(0), seq, 400, 140.0) == 400
    job.feed(ev.CheckpointCommitted(400))
    assert job.status.drain_count == 0 and job.status.recover_count == 0


def test_a_save_late_by_both_clock_and_steps_ends_the_wait() -> None:
    """Training went past step 450 and no save came: the script stopped saving."""
    job, safe = _paused_drain(heard=340)
    safe.step_seen(job.status, job.pod(0), job.status.seq, 450, 116.0)
    [forced] = safe.deadlines_passed(job.status, now=116.0)
    assert "the next save, due by now, has not come" in forced.reason


def test_a_pause_ends_the_wait_once_the_save_cannot_come_before_the_deadline() -> None:
    """The 60 steps to the save take 3.7 s at the pace before the pause (16.3 steps/s), and
    the spare is half an interval (3.1 s): the drain waits until less than that is left before
    its deadline (161)."""
    job, safe = _paused_drain(heard=340)
    assert safe.step_rate == pytest.approx(16.27, abs=0.01)
    assert safe.deadlines_passed(job.status, now=154.0) == []
    [forced] = safe.deadlines_passed(job.status, now=154.5)
    assert "the next save, due by now, has not come" in forced.reason


def test_a_slowdown_that_puts_the_save_past_the_deadline_ends_the_wait_at_once() -> None:
    """Training slowed to a step every 2 s at step 340: at that pace the save at 400 comes
    after the drain's deadline, so waiting on would only delay the drain."""
    job, safe = _paused_drain(heard=340)
    for k in range(1, 13):
        safe.step_seen(job.status, job.pod(0), job.status.seq, 340 + k, 101.0 + 2 * k)
    assert safe.step_rate < 1.0
    [forced] = safe.deadlines_passed(job.status, now=125.0)
    assert "the next save, due by now, has not come" in forced.reason


def test_steps_heard_below_the_last_save_leave_the_clock_to_decide() -> None:
    """A script that numbers its saves otherwise than its steps (samples, say): the step
    cadence cannot be read against the steps, and a late save ends the wait as before."""
    job, safe = running(drain=2), SafePoints("job")
    for step, t in ((20_000, 90.0), (40_000, 100.0)):  # aegis' saves, numbered by samples
        for pod in job.pods:
            safe.committed(job.status, pod, step, t)
    assert safe.save_steps == 20_000
    safe.step_seen(job.status, job.pod(0), job.status.seq, 45, 101.0)  # no pace known yet
    safe.drain((job.pod(2),), deadline_s=60.0, now=101.0)
    assert safe.declined(job.status, job.pod(0), "no requests taken", 101.0) is None
    [forced] = safe.deadlines_passed(job.status, now=116.0)
    assert "the next save, due by now, has not come" in forced.reason


def test_a_drain_asked_for_during_a_pause_waits_for_the_save() -> None:
    """Asked for 20 s after the last save (late by the clock) while training pauses at step
    340: the save is still to come, the drain waits for it rather than resume from step 300."""
    job, safe = _paused_drain(heard=340, at=120.0)
    safe.step_seen(job.status, job.pod(0), job.status.seq, 400, 121.0)  # not heard past 450 yet
    assert safe.deadlines_passed(job.status, now=125.0) == []


def test_the_step_cadence_is_measured_like_the_clocks() -> None:
    """From the start's first step to the first save, then between saves of one run; a restart
    keeps it, a new leader's first look is no start."""
    job, safe = running(), SafePoints("job")
    seq = job.status.seq
    safe.step_seen(job.status, job.pod(0), seq, 0, 0.0)
    safe.step_seen(job.status, job.pod(0), seq, 60, 11.0)
    safe.script_saved(job.status, job.pod(0), seq, 50, 11.0)
    assert safe.save_steps == 50
    safe.rewound()
    assert safe.save_steps == 50 and safe.start_step == -1
    safe.step_seen(job.status, job.pod(0), seq, 50, 20.0)
    safe.step_seen(job.status, job.pod(0), seq, 121, 30.0)
    safe.script_saved(job.status, job.pod(0), seq, 120, 30.0)
    assert safe.save_steps == 50  # the interval is known: the restart's first save is no new one
    safe.step_seen(job.status, job.pod(0), seq, 201, 40.0)
    safe.script_saved(job.status, job.pod(0), seq, 200, 40.0)
    assert safe.save_steps == 80
    other = SafePoints("job")
    other.taken_over(job.status, requested=False, deadline_s=60.0, now=50.0)
    other.step_seen(job.status, job.pod(0), seq, 230, 50.0)
    other.step_seen(job.status, job.pod(0), seq, 270, 52.0)
    other.script_saved(job.status, job.pod(0), seq, 260, 52.0)
    assert other.save_steps is None  # 230 is no start: 260 - 230 is no interval


def test_the_jobs_periodic_commits_set_the_cadence_a_drain_waits_by() -> None:
    """A script that saves through aegis every N steps but takes no requests: its drain waits
    for the next periodic commit, which the pods leave at."""
    job, safe = running(drain=2), SafePoints("job")
    safe.drain((job.pod(2),), deadline_s=60.0, now=100.0)
    for t, step in ((90.0, 20), (100.0, 40)):
        for pod in job.pods:
            safe.committed(job.status, pod, step, t)
    assert safe.declined(job.status, job.pod(0), "no requests taken", 101.0) is None  # waits
    assert [safe.committed(job.status, pod, 60, 110.0) for pod in job.pods][-1] == 60
    job.feed(ev.CheckpointCommitted(60))
    assert job.status.drain_count == 0 and job.status.recover_count == 0


def test_heartbeats_close_together_make_no_step_rate_sample_once_a_rate_is_known() -> None:
    job, safe = running(), SafePoints("job")
    pod, seq = job.pod(0), job.status.seq
    safe.step_seen(job.status, pod, seq, 0, 0.0)
    safe.step_seen(job.status, pod, seq, 20, 1.0)  # 20 steps/s
    safe.step_seen(job.status, pod, seq, 24, 1.1)  # an early beat told a save: 40 steps/s "seen"
    assert safe.step_rate == pytest.approx(20.0)
    safe.step_seen(job.status, pod, seq, 40, 2.0)
    assert safe.step_rate == pytest.approx(20.0)  # from 1.0 to 2.0


def test_the_first_rate_comes_from_the_first_two_heartbeats_however_close() -> None:
    """The first rate places a drain's checkpoint request: it does not wait for a gap."""
    job, safe = running(), SafePoints("job")
    pod, seq = job.pod(0), job.status.seq
    safe.step_seen(job.status, pod, seq, 10, 5.0)
    safe.step_seen(job.status, pod, seq, 20, 5.01)
    assert safe.step_rate > 0


def test_heartbeats_faster_than_the_gap_add_up_to_samples() -> None:
    job, safe = running(), SafePoints("job")
    pod, seq = job.pod(0), job.status.seq
    for k in range(5):  # --heartbeat-s 0.25: 20 steps/s
        safe.step_seen(job.status, pod, seq, 5 * k, 0.25 * k)
    assert safe.step_rate == pytest.approx(20.0)
    assert safe.steps[pod] == (20, 1.0)  # the newest, for the request's target


def test_one_save_told_both_ways_counts_once_in_the_cadence() -> None:
    """A DCP save into aegis' store is the script's own save and a commit of the job: its two
    reports, a moment apart, are one save of the cadence, not an interval of 0.3 s."""
    job, safe = running(), SafePoints("job")
    seq = job.status.seq
    safe.step_seen(job.status, job.pod(0), seq, 1000, 80.0)
    assert safe.script_saved(job.status, job.pod(0), seq, 20, 90.0) is None
    assert safe.script_saved(job.status, job.pod(0), seq, 40, 100.0) is None
    for pod in job.pods:
        safe.committed(job.status, pod, 40, 100.3)
    assert (safe.save_interval, safe.save_last) == (10.0, 100.0)


def test_the_first_interval_runs_from_the_start_and_a_restart_keeps_it() -> None:
    """A fresh job: the first step heard to the first save is a first interval (a drain then
    waits for the next save). A restart keeps the interval (the script's) and anchors the next
    save at the restart's first step, not at a save before the downtime."""
    job, safe = running(drain=2), SafePoints("job")
    seq = job.status.seq
    safe.step_seen(job.status, job.pod(0), seq, 5, 0.0)  # training starts
    safe.step_seen(job.status, job.pod(0), seq, 300, 19.0)
    assert safe.script_saved(job.status, job.pod(0), seq, 200, 20.0) is None  # the first save
    assert (safe.save_interval, safe.save_last) == (20.0, 20.0)
    safe.drain((job.pod(2),), deadline_s=60.0, now=25.0)
    assert safe.declined(job.status, job.pod(0), "no requests taken", 25.0) is None  # waits
    safe.rewound()  # a restart, 100 s of downtime
    assert safe.save_interval == 20.0 and safe.save_last is None
    safe.step_seen(job.status, job.pod(0), seq, 201, 150.0)  # its first step
    assert safe.save_last == 150.0 and save_due(150.0, 20.0, 1.5, 2.0) == 180.0
    for step, t in ((400, 168.0), (600, 186.0)):
        safe.step_seen(job.status, job.pod(0), seq, step + 1, t)
        safe.script_saved(job.status, job.pod(0), seq, step, t)
    assert safe.save_interval == 18.0  # between two saves of the new run only


def test_a_new_leaders_first_look_is_no_start_of_training() -> None:
    job, safe = running(), SafePoints("job")
    seq = job.status.seq
    safe.taken_over(job.status, requested=False, deadline_s=60.0, now=300.0)
    safe.step_seen(job.status, job.pod(0), seq, 1000, 300.0)  # somewhere between two saves
    assert safe.script_saved(job.status, job.pod(0), seq, 900, 301.0) is None
    assert safe.save_interval is None  # one second is not the script's interval
    assert safe.script_saved(job.status, job.pod(0), seq, 950, 311.0) is None
    assert safe.save_interval == 10.0


def test_a_commit_said_before_a_restart_of_a_step_past_the_committed_one_counts_for_nothing() -> (
    None
):
    """Pods a and b committed step 10 and c was about to, when a crash restarted the job from
    step 5 (round r + 1). c's commit of 10 of the abandoned timeline, sent before the restart,
    is heard after it: it counted as c's, and the new timeline's step 10 was taken as
    committed once a and b saved it again, before c had (a crash then resumed c from the old
    timeline's step 10). Now only what is said in the new round counts."""
    job, safe = running(), SafePoints("job")
    a, b, c = job.pods
    old = job.status.seq
    for pod in (a, b, c):
        safe.committed(job.status, pod, 5, 0.0, old)
    for pod in (a, b):
        assert safe.committed(job.status, pod, 10, 0.0, old) is None
    safe.rewound(old + 1)  # the restart's training round resumes from step 5
    assert safe.resume_step() == 5
    assert safe.committed(job.status, c, 10, 1.0, old) is None  # heard late: not counted
    assert safe.committed(job.status, c, 4, 1.0, old) is None  # one at or below: harmless
    for pod in (a, b):
        assert safe.committed(job.status, pod, 10, 2.0, old + 1) is None  # c has not yet
    assert safe.committed_step == 5
    assert safe.committed(job.status, c, 10, 3.0, old + 1) == 10  # now every pod has
    # reports of no round (an older agent's resend said none) count as before
    assert safe.committed(job.status, c, 12, 3.0) is None and c in safe.pod_steps


def test_a_new_leader_knows_the_round_training_restarted_in_from_the_round_orders() -> None:
    from aegis.core.phases import Order
    from aegis.master.job_record import JobNotes
    from aegis.master.job_settings import JobSettings
    from aegis.master.progress import Progress
    from aegis.master.round_orders import RoundOrder

    job = running()
    seq = job.status.seq
    restart = RoundOrder(Order.RESTART, Phase.RUN_COMMAND, seq, tuple(job.pods), 0, {})
    request = RoundOrder(Order.CHECKPOINT, Phase.RUN_COMMAND, seq, (), 0, {})
    for orders, rewound in (([restart, request], seq), ([request], -1), ([], -1)):
        progress = Progress("job", JobSettings(), committed_step=5)
        progress.taken_over(job.status, orders, 60.0, JobNotes(), 0.0, 1000.0)
        assert progress.safe.rewound_seq == rewound
        late = progress.committed(job.status, job.pods[0], 10, 1.0, seq - 1)
        assert late is None and (job.pods[0] in progress.safe.pod_steps) == (rewound < 0)


def test_a_rounds_orders_add_to_the_rounds_list_and_a_new_round_starts_a_new_one() -> None:
    """``Progress.orders_after`` returns the round's orders and leaves the list it is given as it
    was (the runner's stored orders are replaced, never changed behind its back)."""
    from aegis.core import actions as act
    from aegis.core.phases import Order
    from aegis.master.job_settings import JobSettings
    from aegis.master.progress import Progress

    job, progress = running(), Progress("job", JobSettings())
    seq, ports = job.status.seq, iter(range(30000, 30010))

    def after(orders: list, *sent: act.SendOrder) -> list:
        return progress.orders_after(sent, orders, job.spec, job.status, lambda: next(ports),
                                     Phase.RUN_COMMAND, False)  # fmt: skip

    first = after([], act.SendOrder(Order.RUN, Phase.RUN_COMMAND, seq))
    kept = list(first)
    second = after(first, act.SendOrder(Order.CHECKPOINT, Phase.RUN_COMMAND, seq))
    assert first == kept  # not appended to
    assert [o.order for o in second] == [Order.RUN, Order.CHECKPOINT]
    assert {o.seq for o in second} == {seq}
    third = after(second, act.SendOrder(Order.RESTART, Phase.RUN_COMMAND, seq + 1))
    assert [(o.order, o.seq) for o in third] == [(Order.RESTART, seq + 1)]
    assert [o.order for o in second] == [Order.RUN, Order.CHECKPOINT]
    assert after(third) == third and after(third) is not third  # no order sent: the same orders
