"""The master's heartbeat watch (``master.liveness``, pure): who is watched, who is lost."""

from __future__ import annotations

from aegis.core.model import PodName
from aegis.master.liveness import Liveness

A, B = PodName("j-0"), PodName("j-1")


def test_a_watched_pod_silent_past_the_timeout_is_lost_once() -> None:
    live = Liveness(timeout_s=5.0)
    live.seen(A, 100.0)
    live.seen(B, 100.0)
    live.watch(A)
    live.watch(B)
    assert live.lost(105.0) == []  # exactly the timeout: not yet
    live.seen(B, 104.0)
    assert live.lost(105.5) == [A]
    assert live.lost(200.0) == [B]  # A is named once; B later
    assert live.lost(300.0) == [] and live.watched == set()


def test_an_unwatched_pod_is_never_lost_and_a_takeover_gives_a_full_timeout() -> None:
    live = Liveness(timeout_s=5.0)
    live.seen(A, 0.0)  # heard, but not watched yet (no ACK): never lost
    assert live.lost(1000.0) == []
    live.watch_from([A, B], 1000.0)  # a new leader: both watched, from now
    assert live.lost(1004.0) == []
    live.forget(B)  # replaced: no longer watched
    assert live.lost(1006.0) == [A]


def test_a_pod_watched_before_it_was_ever_heard_counts_from_its_first_check() -> None:
    live = Liveness(timeout_s=5.0)
    live.watch(A)
    assert live.lost(10.0) == []  # never heard: no age to judge by
