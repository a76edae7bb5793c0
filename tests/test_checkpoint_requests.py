"""Checkpoint on request, training side: the agent writes a request into the progress file;
``aegis.progress`` says when it is due and ``aegis.checkpoint.save_if_requested`` saves exactly
the requested step, answers it, and holds until stopped. Real processes, a real mapped file."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from aegis import training
from aegis.agent import watchdog
from aegis.checkpoint import api
from tests.waits import wait_until

SCRIPT = """
import sys, torch, aegis, aegis.checkpoint
for step in range(1, int(sys.argv[1]) + 1):
    due = aegis.progress(step)
    saved = aegis.checkpoint.save_if_requested(step, lambda: {"w": torch.full((4,), step)})
    print(step, int(due), int(saved), flush=True)
"""
PROGRESS_ONLY = "import aegis\nfor step in range(1, 6): aegis.progress(step)\n"


@pytest.fixture
def shared() -> Iterator[watchdog.ProgressFile]:
    progress_file = watchdog.ProgressFile()
    yield progress_file
    progress_file.close()


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"aegis-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def env_for(shared: watchdog.ProgressFile, shm: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", training.ENV_VAR: shared.path, "AEGIS_CKPT_SHM": str(shm)}


def run(code: str, env: dict[str, str], *args: str) -> list[tuple[int, ...]]:
    result = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True,
        timeout=120,
    )  # fmt: skip
    return [tuple(int(x) for x in line.split()) for line in result.stdout.splitlines()]


def test_the_requested_step_is_saved_once_and_answered(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    shared.request_checkpoint(7, 5, 0.0)
    lines = run(SCRIPT, env_for(shared, shm), "8")
    assert [(step, due, saved) for step, due, saved in lines if due or saved] == [(5, 1, 1)]
    assert len(lines) == 8  # no hold asked: training went on
    assert shared.answered() == 7 and shared.opted_in()
    saver = api.Saver(api.SaverSettings(shm_dir=shm))
    assert saver.pending_steps() == [5]  # handed to the saver daemon (none runs here)


def test_a_request_past_its_step_is_saved_at_once(shared: watchdog.ProgressFile, shm: Path) -> None:
    shared.request_checkpoint(3, 0, 0.0)
    lines = run(SCRIPT, env_for(shared, shm), "3")
    assert [step for step, _, saved in lines if saved] == [1]
    assert shared.answered() == 3


def test_a_request_seen_past_its_named_step_is_saved_late_and_does_not_hold(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    """This rank's agent got the order after the rank passed step 3 (a slow node's agent is
    stopped part of every period). The other ranks saved step 3 and hold there: holding here
    too would stop them again in the next step's collective, reporting nothing (a hang to the
    watchdog). It saves where it is, answers, and goes on."""
    shared.request_checkpoint(6, 3, time.monotonic() + 3600)
    lines = run(SCRIPT.replace("range(1,", "range(5,"), env_for(shared, shm), "8")
    assert [(step, saved) for step, _, saved in lines] == [(5, 1), (6, 0), (7, 0), (8, 0)]
    assert shared.answered() == 6


def test_no_request_no_save_and_a_script_without_the_api_never_opts_in(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    assert all(saved == 0 for _, _, saved in run(SCRIPT, env_for(shared, shm), "4"))
    assert shared.opted_in() and shared.answered() == 0
    shared.reset()  # a new incarnation forgets the request and the opt-in
    assert not shared.opted_in()
    run(PROGRESS_ONLY, env_for(shared, shm))
    assert not shared.opted_in()


def test_after_saving_the_training_holds_and_keeps_reporting(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    shared.request_checkpoint(1, 3, time.monotonic() + 3600)
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "50"],
        env=env_for(shared, shm),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: shared.answered() == 1, 60, "the request to be answered")
        seen = shared.read()
        assert seen is not None and seen[0] == 3
        wait_until(  # the hold re-reports the step, so the hang watchdog stays quiet
            lambda: (now := shared.read()) is not None and now[1] > seen[1], 30, "a re-report"
        )
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # what the agent does when the pod moves
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert [int(line.split()[0]) for line in out.splitlines()] == [1, 2]  # step 3 never ended


PERIODIC = """
import sys, torch, aegis, aegis.checkpoint
for step in range(1, 50):
    aegis.progress(step)
    state = {"w": torch.full((4,), step)}
    if step % int(sys.argv[2]) == 0:  # one save only: no saver daemon runs here
        aegis.checkpoint.save(step, state)
    elif sys.argv[1] == "api":
        aegis.checkpoint.save_if_requested(step, state)
    print(step, flush=True)
"""


def test_a_periodic_save_while_a_request_is_pending_answers_it_and_holds(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    shared.request_checkpoint(4, 40, time.monotonic() + 3600)  # due late; step 3 comes first
    proc = subprocess.Popen(
        [sys.executable, "-c", PERIODIC, "api", "3"],
        env=env_for(shared, shm),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: shared.answered() == 4, 60, "the periodic save to answer")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert [int(line) for line in out.splitlines()] == [1, 2]  # held in the save of step 3


def test_a_script_without_the_api_never_answers_or_holds(
    shared: watchdog.ProgressFile, shm: Path
) -> None:
    shared.request_checkpoint(5, 40, time.monotonic() + 3600)
    lines = run(PERIODIC, env_for(shared, shm), "plain", "30")
    assert len(lines) == 49  # ran to the end: its periodic saves neither answered nor held
    assert shared.answered() == 0 and not shared.opted_in()
