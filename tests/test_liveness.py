"""The master's heartbeat watch (``master.liveness``, pure): who is watched, who is lost, who
is awaited back and has not come back in time."""

from __future__ import annotations

from aegis.core import events as ev
from aegis.core.model import PodName
from aegis.core.phases import Phase
from aegis.master.liveness import LINK_SLOW_S, Liveness
from tests.core_helpers import Driver

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
    live.forget(B, 1005.0)  # replaced: no longer watched
    assert live.lost(1006.0) == [A]


def test_a_pod_watched_before_it_was_ever_heard_counts_from_its_first_check() -> None:
    live = Liveness(timeout_s=5.0)
    live.watch(A)
    assert live.lost(10.0) == []  # never heard: no age to judge by


def test_a_pod_sent_away_is_awaited_from_its_placement_and_named_each_timeout_until_its_ack() -> (
    None
):
    live = Liveness(timeout_s=5.0, join_timeout_s=60.0)
    live.watch(A)
    live.forget(A, 100.0)  # lost: replaced
    assert live.not_back(160.5) == [A]  # never placed: named from the ask
    live.forget(A, 170.0)  # the platform placed it: the wait starts again
    assert live.not_back(230.0) == []  # exactly the timeout: not yet
    assert live.overdue(230.5) == [ev.JoinTimedOut(A, "did not come back within 60 s")]
    assert live.not_back(260.0) == []  # named once per timeout: awaited again from 230.5
    assert live.not_back(291.0) == [A]
    live.watch(A)  # its ACK: back
    assert live.not_back(1000.0) == [] and live.awaited == {}


def test_no_join_timeout_awaits_nobody_and_a_takeover_awaits_the_pods_away() -> None:
    live = Liveness(timeout_s=5.0)  # join_timeout_s 0: off
    live.forget(A, 0.0)
    assert live.not_back(10_000.0) == []
    d = Driver()
    taken = Liveness(timeout_s=5.0, join_timeout_s=60.0)
    taken.taken_over(d.status, 50.0)  # the job has not started: its first pods are not awaited
    assert taken.awaited == {}
    d.feed(ev.PodAcked(d.pod(2)))
    d.feed(ev.HeartbeatLost(d.pod(2)))  # lost before the job started: sent away all the same
    assert d.status.phase is Phase.PENDING
    taken.taken_over(d.status, 55.0)
    assert taken.awaited == {d.pod(2): 55.0}  # a replaced pod is awaited; the first pods are not
    d = Driver()
    d.to_running()
    d.feed(ev.HeartbeatLost(d.pod(1)))  # away, awaiting its replacement
    assert d.status.phase is Phase.RESTARTING
    taken = Liveness(timeout_s=5.0, join_timeout_s=60.0)
    taken.taken_over(d.status, 50.0)
    assert taken.awaited == {d.pod(1): 50.0}
    assert taken.watched == {d.pod(0), d.pod(2)}


def test_no_silence_counts_while_the_master_hears_nobody_and_each_pod_gets_a_full_timeout() -> None:
    live = Liveness(timeout_s=5.0, join_timeout_s=60.0)
    for pod in (A, B):
        live.seen(pod, 100.0)
        live.watch(pod)
    live.forget(B, 100.0)  # B away, awaited back
    assert not live.due(104.0)
    assert live.due(105.5)  # A silent past the timeout: it would be named ...
    assert not live.hearing(False, 105.5)  # ... but the master's own link is down
    assert live.deaf and not live.hearing(False, 200.0)
    assert live.watched == {A} and live.awaited == {B: 100.0}  # nothing judged meanwhile
    assert live.hearing(True, 200.0)  # back: everyone has a full timeout from now
    assert not live.deaf and not live.due(205.0)
    assert live.overdue(205.0) == []
    assert live.overdue(205.5) == [ev.HeartbeatLost(A)]  # still silent a full timeout later
    assert live.not_back(260.0) == [] and live.not_back(260.5) == [B]


def test_a_slow_answer_of_the_bus_counts_as_an_outage_that_ends_now() -> None:
    """A round trip slower than ``LINK_SLOW_S``: the bus was hung until just now, and the pods'
    heartbeats sent meanwhile may still be on their way: nobody is judged on it; at the next
    look every pod has a full timeout."""
    live = Liveness(timeout_s=5.0)
    live.seen(A, 100.0)
    live.watch(A)
    assert live.due(106.0)
    assert not live.hearing(True, 107.0, answered_s=LINK_SLOW_S + 0.5)
    assert live.deaf and live.watched == {A}
    assert live.hearing(True, 107.3, answered_s=0.01)
    assert not live.due(112.0) and live.overdue(112.4) == [ev.HeartbeatLost(A)]
    fast = Liveness(timeout_s=5.0)
    fast.seen(A, 100.0)
    fast.watch(A)
    assert fast.hearing(True, 106.0, answered_s=LINK_SLOW_S / 2)  # an answer in time: judged
    assert fast.overdue(106.0) == [ev.HeartbeatLost(A)]
