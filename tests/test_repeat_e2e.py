"""Restart or stop, end to end on the emulated cluster: a plain DDP script (no aegis import;
its steps come from the optimizer hook) whose rank 1 raises at the same step in every
incarnation ends Failed after three, with the verdict in ``aegis status`` and
``aegis incidents``, though the budget would allow ten; raising at another step each time is
restarted every time and the job succeeds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import AEGIS, leftovers, run_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

SCRIPT = Path(__file__).parent / "bin" / "plain_ddp.py"


def _cli(*args: str) -> str:
    result = subprocess.run([*AEGIS, *args], check=False, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def _command(tmp_path: Path, shift: int) -> list[str]:
    return [sys.executable, str(SCRIPT), "--steps", "80", "--ckpt-every", "1000",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--crash-at-step", "30", "--crash-rank", "1",
            "--crash-times", "3" if shift else "99", "--crash-step-shift", str(shift)]  # fmt: skip


async def test_the_same_crash_at_the_same_step_stops_the_job_after_three(tmp_path: Path) -> None:
    run = await run_cluster(tmp_path, ["--nodes", "3", "--max-retry", "10", "--job", "r"],
                            _command(tmp_path, 0))  # fmt: skip
    assert run.rc != 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Failed" and status["recover_count"] == 3, status
    verdict = "the same fault 3 times in a row at step 29"
    assert verdict in run.pods["r-1"]["last_failed_reason"], run.pods
    assert (
        "RuntimeError: injected crash of rank 1 at step 30" in run.pods["r-1"]["last_failed_reason"]
    )
    shown = json.loads(_cli("status", "r", "--log-dir", str(run.log_dir), "--json"))
    assert verdict in shown["pods"][1]["last_failed_reason"]
    assert shown["ending"] == "RepeatedFault" and shown["ended"].startswith(verdict), shown
    said = _cli("status", "r", "--log-dir", str(run.log_dir)).splitlines()[0]
    assert said.startswith(f"job r: Failed: {verdict}"), said
    last = run.output.splitlines()[-1]  # aegis run's own last line says why too
    assert last.startswith(f"aegis run: job r Failed ({verdict}"), last
    found = json.loads(_cli("incidents", "r", "--log-dir", str(run.log_dir), "--json"))
    decisions = [d["text"] for incident in found for d in incident["decisions"]]
    assert any(text.startswith(f"job Failed: {verdict}") for text in decisions), decisions
    assert leftovers(run.log_dir) == []


async def test_a_crash_at_another_step_each_time_is_restarted_every_time(tmp_path: Path) -> None:
    run = await run_cluster(tmp_path, ["--nodes", "3", "--max-retry", "10", "--job", "v"],
                            _command(tmp_path, 5))  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 3, status
    assert status["repeat"]["count"] == 1  # each crash at its own step
    assert leftovers(run.log_dir) == []


async def test_a_crash_before_the_first_step_stops_the_job_after_three(tmp_path: Path) -> None:
    # A script that cannot start (here a module that is not installed) used to be restarted
    # until the whole budget was spent: no step was known, so no run of the same fault began.
    command = [sys.executable, "-c", "import torch\nimport not_installed_module_x\n"]
    run = await run_cluster(tmp_path, ["--nodes", "2", "--max-retry", "10", "--job", "s"],
                            command)  # fmt: skip
    assert run.rc == 1, run.output
    status = run.status["status"]
    assert status["phase"] == "Failed" and status["recover_count"] == 3, status
    verdict = "the same fault 3 times in a row at step 0"
    reasons = [info["last_failed_reason"] for info in run.pods.values()]
    assert any(verdict in r and "No module named 'not_installed_module_x'" in r for r in reasons)
    shown = json.loads(_cli("status", "s", "--log-dir", str(run.log_dir), "--json"))
    assert shown["ending"] == "RepeatedFault", shown
    assert leftovers(run.log_dir) == []
