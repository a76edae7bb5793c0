"""How long an ended job's record stays in the status bucket (pure: the replica does the I/O).

An ended job's record is kept for ``aegis status --nats`` and for the credentials handshake to
refuse its pods ("ended"); kept forever, every poll of the bucket lists every job ever run and
costs more the longer a master serves (the 2-hour soak of issue 20: the poll's CPU grew 2.8x).
The leader removes a record once the job has been seen ended for ``keep_ended_s``, at the
revision it was seen ended at (a newer record under the same key, a job submitted again, stays).
The clock is the replica's monotonic one from the moment *it* saw the job ended: a master that
starts later keeps every old record at least ``keep_ended_s`` more, never less."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

KEEP_ENDED_S = 7 * 24 * 3600.0  # a week of `aegis status --nats` after a job ends


@dataclass(frozen=True, slots=True)
class Ended:
    seen_at: float  # monotonic, when this replica first saw the job ended
    revision: int  # the record's revision then (0: not known; the record stays)


def expired(ended: Mapping[str, Ended], now: float, keep_ended_s: float) -> list[str]:
    """The ended jobs whose records are to be removed now, sorted (none for ``keep_ended_s`` <= 0:
    kept forever)."""
    if keep_ended_s <= 0:
        return []
    return sorted(
        key
        for key, seen in ended.items()
        if seen.revision > 0 and now - seen.seen_at >= keep_ended_s
    )


def still_listed(ended: Mapping[str, Ended], listed: Iterable[str]) -> dict[str, Ended]:
    """The ended jobs whose keys the bucket still lists: a record removed (by the leader, or by
    hand) is forgotten, so what a replica keeps is bounded by the retention, not by the jobs
    ever run."""
    present = set(listed)
    return {key: seen for key, seen in ended.items() if key in present}
