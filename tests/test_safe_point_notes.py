"""A new leader goes on with the old one's save cadence and waits (``master.safe_point_notes``):
a drain waiting for a script's next own save keeps waiting for it, the pods leave at it, an
overdue save still ends the wait, and the drain deadlines stay where they were. The notes travel
in the job's record, their times as wall-clock times (the leaders' monotonic clocks differ)."""

from __future__ import annotations

import json
import time

import msgspec

from aegis.adapters import memory
from aegis.core import events as ev
from aegis.master import job_builder, job_record, records
from aegis.master.job_runner import JobSettings
from aegis.master.ports import NullPlatform
from aegis.master.progress import Progress
from aegis.master.safe_point_notes import SafePointNotes, note, restore
from aegis.master.safe_points import SafePoints
from aegis.wire import messages as m
from tests.core_helpers import Driver
from tests.test_job_record import OLD_RECORD

# The old leader's monotonic clock read 101.0 when the wall clock read 1000.0; the new leader's
# reads 5.0 three seconds later (wall 1003.0).
OLD_MONO, OLD_WALL, NEW_MONO, NEW_WALL = 101.0, 1000.0, 5.0, 1003.0


def _waiting_drain() -> tuple[Driver, SafePoints]:
    """Pod 2 drains (deadline 60 s from mono 100); pod 0's script saved on its own at steps 20
    and 40, at 90 and 100 (every 10 s: the next one due by 115), then declined the request:
    the drain waits for that save."""
    job = Driver(workers=3)
    job.to_running()
    job.feed(ev.DrainRequested((job.pod(2),), "maintenance"))
    safe, seq = SafePoints("job"), job.status.seq
    safe.drain((job.pod(2),), deadline_s=60.0, now=100.0)
    safe.step_seen(job.status, job.pod(0), seq, 1000, 80.0)
    for step, t in ((20, 90.0), (40, 100.0)):
        assert safe.script_saved(job.status, job.pod(0), seq, step, t) is None
    assert safe.declined(job.status, job.pod(0), "no requests taken", OLD_MONO) is None
    return job, safe


def _new_leader(job: Driver, notes: SafePointNotes | None) -> SafePoints:
    """A new leader's safe points, from the notes as the record carries them (JSON)."""
    safe = SafePoints("job")
    safe.taken_over(job.status, requested=True, deadline_s=60.0, now=NEW_MONO)
    if notes is not None:
        stored = msgspec.json.decode(msgspec.json.encode(notes), type=SafePointNotes)
        restore(safe, stored, job.status, NEW_MONO, NEW_WALL)
    safe.step_seen(job.status, job.pod(0), job.status.seq, 1000, NEW_MONO + 1)
    return safe


def test_a_new_leader_takes_the_scripts_next_own_save_the_drain_waited_for() -> None:
    job, old = _waiting_drain()
    safe = _new_leader(job, note(old, OLD_MONO, OLD_WALL))
    # the deadline (mono 160 = wall 1059) is 56 s after the new leader's 1003
    assert safe.drain_deadlines == {job.pod(2): (NEW_MONO + 56.0, 60.0)}
    assert safe.declined(job.status, job.pod(1), "no requests taken", NEW_MONO + 1) is None
    assert safe.script_saved(job.status, job.pod(0), job.status.seq, 60, NEW_MONO + 6) == 60
    job.feed(ev.CheckpointCommitted(60))
    assert job.status.drain_count == 0 and job.status.recover_count == 0


def test_without_notes_a_new_leader_lets_that_save_pass() -> None:
    """The old behaviour (a record of an older master): the save is not taken, the drain
    waits for its full deadline from the takeover."""
    job, _ = _waiting_drain()
    safe = _new_leader(job, None)
    assert safe.drain_deadlines == {job.pod(2): (NEW_MONO + 60.0, 60.0)}
    assert safe.script_saved(job.status, job.pod(0), job.status.seq, 60, NEW_MONO + 6) is None


def test_a_new_leader_ends_the_wait_when_the_save_is_overdue() -> None:
    job, old = _waiting_drain()
    safe = _new_leader(job, note(old, OLD_MONO, OLD_WALL))
    # due by mono 115 = wall 1014: the new leader's 16
    assert safe.deadlines_passed(job.status, now=NEW_MONO + 11.0) == []
    [forced] = safe.deadlines_passed(job.status, now=NEW_MONO + 11.1)
    assert forced.pods == (job.pod(2),)
    assert "the next save, due by now, has not come" in forced.reason


def test_a_save_reported_by_a_clock_ahead_counts_as_reported_now() -> None:
    job, old = _waiting_drain()
    notes = note(old, OLD_MONO, OLD_WALL)
    assert notes is not None
    ahead = msgspec.structs.replace(notes, last_wall=NEW_WALL + 30.0)
    safe = _new_leader(job, ahead)
    assert safe.save_last == NEW_MONO


def test_nothing_to_note_leaves_the_notes_out_of_the_record() -> None:
    assert note(SafePoints("job"), OLD_MONO, OLD_WALL) is None


async def test_a_record_with_notes_is_adopted_with_its_cadence_and_written_back() -> None:
    """The notes in the store reach the new leader's runner: its save cadence is the old
    one's, and the record it writes at the takeover keeps them."""
    last_wall = time.time() - 4.0
    raw = json.loads(OLD_RECORD)
    raw["safe_points"] = {"interval_s": 10.0, "last_wall": last_wall, "step": 40,
                          "interval_steps": 20, "start_step": 3}  # fmt: skip
    store, bus = memory.MemoryStore(), memory.MemoryBus()
    encoded = json.dumps(raw).encode()
    revision = await store.put("default.up", encoded, expected_revision=None)
    record, _, _ = records.decode_record(encoded)
    assert record.safe_points == SafePointNotes(
        interval_s=10.0, last_wall=last_wall, step=40, interval_steps=20, start_step=3
    )
    builder = job_builder.JobBuilder(bus, store, JobSettings(heartbeat_timeout_s=60))
    runner = builder.adopt(record, revision, NullPlatform(), None, epoch=4, fence=lambda: None)
    await runner.takeover()
    safe = runner.safe
    assert safe.save_interval == 10.0 and safe.cadence_step == 40 and safe.start_heard
    assert (safe.save_steps, safe.start_step) == (20, 3)
    assert safe.save_last is not None and time.monotonic() - safe.save_last >= 4.0
    got = await store.get("default.up")
    assert got is not None
    written = job_record.decode(got[0]).safe_points
    assert written is not None and (written.interval_s, written.step) == (10.0, 40)
    assert (written.interval_steps, written.start_step) == (20, 3)
    assert abs(written.last_wall - last_wall) < 1.0  # the same save, as the new leader sees it
    await runner.unsubscribe()


def test_a_save_told_again_after_the_takeover_is_not_the_one_awaited() -> None:
    """The old leader died before its record had the wait: the agent tells the decline again,
    and its script's save at step 40 again (it does now and then). The new leader knows step 40
    from the notes, so only a newer save is taken."""
    job, old = _waiting_drain()
    old.script_wait, old.declined_seq, old.drain_waits = None, -1, -1  # the wait unwritten
    safe = _new_leader(job, note(old, OLD_MONO, OLD_WALL))
    seq = job.status.seq
    assert safe.declined(job.status, job.pod(0), "no requests taken", NEW_MONO + 1) is None
    assert safe.script_saved(job.status, job.pod(0), seq, 40, NEW_MONO + 2) is None
    assert safe.script_saved(job.status, job.pod(0), seq, 60, NEW_MONO + 6) == 60


def test_the_record_is_written_at_once_for_a_save_or_a_wait_not_for_a_heartbeat() -> None:
    job = Driver(workers=3)
    job.to_running()
    progress, seq, pod = Progress("job", JobSettings()), job.status.seq, job.pod(0)
    progress.note(job_record.JobNotes(), 0.0, OLD_WALL)  # a record written
    beat = m.HeartbeatData(step=10)
    progress.step_seen(job.status, pod, seq, beat, 1.0)  # the start of training: noted
    assert progress.notes_moved()
    progress.note(job_record.JobNotes(), 1.0, OLD_WALL)
    for k in range(2, 6):
        progress.step_seen(job.status, pod, seq, msgspec.structs.replace(beat, step=10 * k), k)
        assert not progress.notes_moved()
    assert progress.safe.script_saved(job.status, pod, seq, 45, 6.0) is None
    assert progress.notes_moved()  # a save of the cadence
    progress.note(job_record.JobNotes(), 6.0, OLD_WALL)
    assert not progress.notes_moved()


def test_a_new_leader_keeps_the_step_cadence_a_pause_is_judged_by() -> None:
    """The old leader knew the script saves every 20 steps (the last at 40); the new one hears
    training paused at step 50: the save due by the clock is not overdue, as it was not for the
    old leader, until training goes 1.5 intervals of steps past 40."""
    job, old = _waiting_drain()
    notes = note(old, OLD_MONO, OLD_WALL)
    assert notes is not None and (notes.interval_steps, notes.step) == (20, 40)
    safe = SafePoints("job")
    safe.taken_over(job.status, requested=True, deadline_s=60.0, now=NEW_MONO)
    restore(safe, msgspec.json.decode(msgspec.json.encode(notes), type=SafePointNotes),
            job.status, NEW_MONO, NEW_WALL)  # fmt: skip
    assert (safe.save_steps, safe.cadence_step) == (20, 40)
    # 9 s past due by the clock: the new leader hears the step before it judges
    assert safe.deadlines_passed(job.status, now=NEW_MONO + 20.0) == []
    safe.step_seen(job.status, job.pod(0), job.status.seq, 50, NEW_MONO + 20.0)
    assert safe.deadlines_passed(job.status, now=NEW_MONO + 20.1) == []  # paused
    safe.step_seen(job.status, job.pod(0), job.status.seq, 70, NEW_MONO + 21.0)
    [forced] = safe.deadlines_passed(job.status, now=NEW_MONO + 21.0)
    assert "the next save, due by now, has not come" in forced.reason
