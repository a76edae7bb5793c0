"""What a new leader needs to go on with a job's save cadence and its waits for a save
(``SafePoints``), kept in the job's record (``JobNotes.safe_points``).

Without it a new leader knew no cadence: a drain waiting for a script's next own save lost its
wait (the pod left only at the drain's deadline, a full one from the takeover), and a pod
waiting for that save was no longer taken out at it. The leaders' monotonic clocks differ, so
the times are stored as wall-clock times and read back against the new leader's clocks (a
save reported "in the future", by a clock ahead of this one, is taken as reported now).
"""

from __future__ import annotations

import msgspec

from aegis.core.model import JobStatus, PodName
from aegis.master.safe_points import SafePoints


class SafePointNotes(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    interval_s: float = 0.0  # between two saves (0: not known yet)
    last_wall: float = 0.0  # the last save's report, or the start of this run (0: neither)
    start_heard: bool = True  # ``last_wall`` is a start of training heard (not a new leader's)
    step: int = -1  # the last save's step in this run of training (-1: none yet)
    interval_steps: int = 0  # the steps between two saves (0: not known yet)
    start_step: int = -1  # the first step heard of this run of training (-1: none)
    declined_round: int = -1  # the round a script declined a request in (told once)
    wait_round: int = -1  # the round pods wait for the script's next own save in (-1: none)
    wait_after: int = -1  # the newest own save when they began to wait (the one awaited is newer)
    taken_round: int = -1  # the round a script's own save was taken as the commit in
    drain_waits: int = -1  # the round a drain waits for the next save in
    # each pod's last own save (round, step): a save told again after the takeover is no new one
    saves: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)
    # each draining pod's deadline (wall clock) and the seconds it was given
    deadlines: dict[str, tuple[float, float]] = msgspec.field(default_factory=dict)


def key(safe: SafePoints) -> tuple[object, ...]:
    """What the notes are made of, as the leader holds it: the notes are to be written again
    when it changes."""
    return (safe.save_interval, safe.save_last, safe.start_heard, safe.cadence_step,
            safe.save_steps, safe.start_step,
            safe.declined_seq, safe.script_wait, safe.script_taken, safe.drain_waits,
            tuple(sorted(safe.drain_deadlines.items())),
            tuple(sorted(safe.script_saves.items())))  # fmt: skip


def note(safe: SafePoints, now: float, wall: float) -> SafePointNotes | None:
    """The notes of ``safe`` now (``now``: its monotonic clock; ``wall``: the wall clock);
    None while there is nothing to note (the record leaves them out)."""

    def to_wall(mono: float) -> float:
        return wall - (now - mono)

    waiting, last = safe.script_wait or (-1, -1), safe.save_last
    notes = SafePointNotes(
        interval_s=safe.save_interval or 0.0,
        last_wall=to_wall(last) if last is not None else 0.0,
        start_heard=safe.start_heard or last is None, step=safe.cadence_step,
        interval_steps=safe.save_steps or 0, start_step=safe.start_step,
        declined_round=safe.declined_seq,
        wait_round=waiting[0], wait_after=waiting[1], taken_round=safe.script_taken,
        drain_waits=safe.drain_waits,
        deadlines={p: (to_wall(t), s) for p, (t, s) in safe.drain_deadlines.items()},
        saves={str(p): saved for p, saved in safe.script_saves.items()},
    )  # fmt: skip
    return None if notes == SafePointNotes() else notes


def restore(
    safe: SafePoints, notes: SafePointNotes, status: JobStatus, now: float, wall: float
) -> None:
    """A new leader (after ``SafePoints.taken_over``) goes on from the old one's notes: the
    cadence, the waits of the current round, and the deadlines of the pods still draining."""

    def to_mono(stamp: float) -> float:
        return now + (stamp - wall)

    if notes.interval_s > 0:
        safe.save_interval = notes.interval_s
    if notes.interval_steps > 0:
        safe.save_steps = notes.interval_steps
    if notes.last_wall > 0:
        safe.save_last = min(to_mono(notes.last_wall), now)
        safe.start_heard = notes.start_heard
        safe.cadence_step, safe.start_step = notes.step, notes.start_step
    seq = status.seq
    if notes.wait_round == seq:
        safe.script_wait = (seq, notes.wait_after)
    safe.declined_seq = seq if notes.declined_round == seq else safe.declined_seq
    safe.script_taken = seq if notes.taken_round == seq else safe.script_taken
    safe.drain_waits = seq if notes.drain_waits == seq else safe.drain_waits
    for pod, (round_, step) in notes.saves.items():
        if round_ == seq:
            safe.script_saves[PodName(pod)] = (seq, step)
    for pod, (deadline, seconds) in notes.deadlines.items():
        info = status.pod_infos.get(PodName(pod))
        if info is not None and info.drain:
            safe.drain_deadlines[PodName(pod)] = (to_mono(deadline), seconds)
