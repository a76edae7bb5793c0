"""The retention of ended jobs' records (pure rule; the replica's use of it is in
``test_master_retention.py``)."""

from __future__ import annotations

from aegis.core.retention import Ended, expired, still_listed


def test_a_record_is_removed_once_its_job_was_seen_ended_for_the_retention() -> None:
    ended = {"ns.old": Ended(seen_at=10.0, revision=7), "ns.new": Ended(seen_at=95.0, revision=9)}
    assert expired(ended, now=59.9, keep_ended_s=50.0) == []
    assert expired(ended, now=60.0, keep_ended_s=50.0) == ["ns.old"]
    assert expired(ended, now=145.0, keep_ended_s=50.0) == ["ns.new", "ns.old"]


def test_no_retention_keeps_every_record_and_an_unknown_revision_is_never_removed() -> None:
    ended = {"ns.a": Ended(seen_at=0.0, revision=3), "ns.b": Ended(seen_at=0.0, revision=0)}
    assert expired(ended, now=1e9, keep_ended_s=0.0) == []
    assert expired(ended, now=1e9, keep_ended_s=1.0) == ["ns.a"]


def test_keys_the_bucket_no_longer_lists_are_forgotten() -> None:
    ended = {"ns.a": Ended(1.0, 3), "ns.b": Ended(2.0, 4)}
    assert still_listed(ended, ["ns.b", "ns.live"]) == {"ns.b": Ended(2.0, 4)}
    assert still_listed(ended, []) == {}
