"""On the emulated cluster: a training that ignores SIGTERM, with a grace period of 900 s. The
first Ctrl-C asks the job to end, and the run would wait out the grace period before it killed
the training; the second kills the pods at once, and the run still takes down all it started
and exits as Ctrl-C says (130). Before, a second Ctrl-C was only logged."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aegis.platforms import run_settings
from tests import agent_waits, waits
from tests.cluster import leftovers, run_cluster
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

IGNORE_TERM = agent_waits.BIN / "ignore_term.py"  # a plain script: only SIGKILL ends it


def ready(log_dir: Path, pod: str, processes: int = 1) -> bool:
    path = log_dir / "pods" / f"{pod}.log"
    return path.exists() and path.read_text(errors="replace").count("READY") >= processes


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def naming(tmp_path: Path) -> list[int]:
    """The live processes whose command line names ``tmp_path`` (the run's, its pods')."""
    return [int(line.split(":", 1)[0]) for line in leftovers(tmp_path)]


def said(log_dir: Path, what: str) -> bool:
    """Whether the run's event log holds ``what`` (a replicated run's is in a job folder)."""
    return any(what in path.read_text(errors="replace") for path in log_dir.rglob("events.jsonl"))


@pytest.mark.parametrize(
    ("masters", "terminal", "torchrun"),
    [("1", False, False), ("2", False, False), ("1", True, False), ("1", False, True)],
)
async def test_a_second_ctrl_c_kills_the_pods_without_their_grace_period(
    tmp_path: Path, masters: str, terminal: bool, torchrun: bool
) -> None:
    """``terminal``: each Ctrl-C goes to the run's whole process group, as a terminal sends it.
    The run inside the cluster's namespace heard it directly and again from the run outside,
    which passes it on: the first Ctrl-C already killed the pods. ``torchrun``: two workers a
    pod, each in a session of its own; the kill missed them, and they trained on for good."""
    workers = 2 if torchrun else 1

    async def ctrl_c_twice(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        await async_wait_until(lambda: all(ready(log_dir, f"ss-{r}", workers) for r in (0, 1)),
                               120, "every rank up")  # fmt: skip

        def ctrl_c() -> None:
            if terminal:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGINT)

        ctrl_c()
        await async_wait_until(lambda: said(log_dir, '"QuitRequested"'), 60, "the job quit")
        await asyncio.sleep(2 * run_settings.ECHO_S)  # a person's second Ctrl-C: not an echo
        ctrl_c()

    command = [sys.executable, str(IGNORE_TERM), str(tmp_path)]  # (its argv names tmp_path)
    if torchrun:
        command[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    flags = ["--nodes", "2", "--spare-nodes", "0", "--job", "ss", "--grace-s", "900",
             "--masters", masters]  # fmt: skip
    try:
        # (without the second Ctrl-C's kill the run waits out the 900 s: past this timeout)
        run = await run_cluster(tmp_path, flags, command, during=ctrl_c_twice, timeout_s=240,
                                own_group=terminal)  # fmt: skip
        assert run.rc == 128 + signal.SIGINT, run.output
        assert run.output.count("SIGINT again: the pods are killed now") == 1, run.output
        assert "Failed (aegis run got SIGINT)" in run.output.splitlines()[-1], run.output[-2000:]
        # agents, trainings, torchrun's workers, node holders
        await async_wait_until(lambda: not naming(tmp_path), 30, "nothing of the run left")
    finally:  # a failed run may have left processes waiting out the grace period, or orphans
        kill_all(naming(tmp_path))


def test_on_a_shared_host_the_killed_pods_leave_no_checkpoint_memory(tmp_path: Path) -> None:
    """Without ``--isolate-nodes`` every pod's checkpoint memory and its agent's progress file
    are in this host's ``/dev/shm``, which outlives the run: a killed agent cannot remove its
    own, and the run removes them. (Before, the progress files stayed until another agent
    started on the host.)"""
    job = f"sh{os.getpid()}"  # (its memory is named after the job: another run's is not it)
    log_dir = tmp_path / "logs"
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--nodes", "2", "--spare-nodes", "0",
            "--job", job, "--grace-s", "900", "--view", "plain", "--log-dir", str(log_dir),
            "--", sys.executable, str(IGNORE_TERM), str(tmp_path)]  # fmt: skip
    memory = lambda: sorted(Path("/dev/shm").glob(f"aegis-{job}-*"))  # noqa: E731
    progress = lambda: set(Path("/dev/shm").glob("aegis-progress-*"))  # noqa: E731
    before = progress()
    with (tmp_path / "out.log").open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        waits.wait_until(lambda: all(ready(log_dir, f"{job}-{r}") for r in (0, 1)), 120,
                         "both ranks up")  # fmt: skip
        assert len(memory()) == 2, memory()
        proc.send_signal(signal.SIGINT)
        waits.wait_until(lambda: said(log_dir, '"QuitRequested"'), 60, "the job quit")
        time.sleep(2 * run_settings.ECHO_S)  # a person's second Ctrl-C: not an echo
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 128 + signal.SIGINT
        assert "SIGINT again: the pods are killed now" in (tmp_path / "out.log").read_text()
        assert memory() == []
        assert sorted(progress() - before) == []  # the killed agents' progress files too
        waits.wait_until(lambda: not naming(tmp_path), 30, "nothing of the run left")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_all(naming(tmp_path))
