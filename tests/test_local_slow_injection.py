"""``--inject-fault NODE:slow`` on the local platform: the node turns slow at the first committed
checkpoint that comes two pace windows after the first pod started, so that the master's pace
watch has measured a pace to see drop. Before, a checkpoint in the first seconds turned it slow
before the watch had any pace, and the slowdown was never found (the README's command with
``--ckpt-every 20`` trained at a quarter of its pace for five minutes, no round). A node that
never turned slow is said at the end."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from aegis.core import events as ev
from aegis.platforms import local, run_settings
from aegis.platforms.local import LocalPlatform, LocalSettings


@pytest.mark.parametrize(
    ("first_start", "now", "after_s", "due"),
    [
        (None, 100.0, 0.0, True),  # no wait asked: at the first commit
        (None, 100.0, 60.0, False),  # no pod started yet
        (10.0, 69.9, 60.0, False),
        (10.0, 70.0, 60.0, True),
    ],
)
def test_a_commit_turns_the_node_slow_only_after_the_wait(
    first_start: float | None, now: float, after_s: float, due: bool
) -> None:
    assert local.slow_due(first_start, now, after_s) is due


def platform(tmp_path: Path, after_s: float) -> LocalPlatform:
    settings = LocalSettings(nodes=("node-0", "node-1"), spares=(), command=("true",),
                             log_dir=tmp_path, inject={"node-1": frozenset({"slow"})},
                             slow_from_start=False, slow_after_s=after_s)  # fmt: skip
    return LocalPlatform(settings, local.SharedHost())


async def test_a_commit_before_any_pod_started_leaves_the_node_as_it_is_and_the_end_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    waiting = platform(tmp_path, 60.0)
    waiting.turn_slow_at_commit(ev.CheckpointCommitted(step=20))
    assert waiting.slowed == set() and waiting.never_slowed() == ["node-1"]
    with caplog.at_level(logging.WARNING, logger="aegis.platforms.local"):
        await waiting.stop_all()
    assert any("node-1:slow never took effect" in r.getMessage() for r in caplog.records)
    at_once = platform(tmp_path, 0.0)
    at_once.turn_slow_at_commit(ev.CheckpointCommitted(step=20))
    assert at_once.slowed == {"node-1"} and at_once.never_slowed() == []


def test_aegis_run_waits_two_pace_windows(tmp_path: Path) -> None:
    made = run_settings.local_settings(
        run_settings.RunSettings(command=("true",), pace_window_s=30.0), tmp_path
    )
    assert made.slow_after_s == 60.0 and not made.slow_from_start
