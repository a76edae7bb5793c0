"""Short chaos soaks on the emulated cluster (``benchmarks/chaos_soak.py``).

Seed 17, one master in the run's process: a node that loses every process, the NATS server
SIGKILLed, an agent SIGKILLed, the NATS server again, a training SIGKILLed. Seed 88, three
master processes and three spares: a node lost, the NATS server SIGKILLed, a node turned slow,
a training stopped (a hang), a training SIGKILLed, the leading master SIGKILLed, an agent
SIGKILLed. Each time: the run exits 0, every fault of the job is counted once and a hang is
judged for the stopped training only, the pod of a hang or a slow node moved off it at the next
commit and every node lost, hung on or slow is blacklisted, the loss of a master or of NATS
restarts and counts nothing and a slow node counts nothing, each restart restarts every rank
from the step the master named with that step's values, and nothing is left. And a node that
turns slow as training restarts in place after a crash: the pace watch compares with the pace
before the restart (the round's own pace would be its best, and nothing named the node); and
the same when the leading master dies at the crash: the new leader finds that pace in the job's
record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import require_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SOAK = Path(__file__).parent.parent / "benchmarks" / "chaos_soak.py"


def soaked(tmp_path: Path, *flags: str) -> list[str]:
    """The kinds of the faults the soak injected, in order, once it passed."""
    require_namespaces()
    argv = [sys.executable, str(SOAK), *flags, "--work", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=840, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "chaos soak: passed" in said, said
    return [line.split()[2] for line in said.splitlines() if line.startswith("fault ")]


def test_five_faults_of_four_kinds_in_one_job_leave_it_whole(tmp_path: Path) -> None:
    kinds = soaked(tmp_path, "--faults", "5", "--seed", "17", "--kinds", "crash,agent,node,nats")
    assert kinds == ["node", "nats", "agent", "nats", "crash"], kinds


def test_a_hang_a_slow_node_and_the_leaders_loss_among_faults_of_every_kind(
    tmp_path: Path,
) -> None:
    flags = ["--faults", "7", "--seed", "88", "--kinds", "crash,agent,node,hang,master,nats,slow",
             "--masters", "3", "--spares", "3"]  # fmt: skip
    kinds = soaked(tmp_path, *flags)
    assert kinds == ["node", "nats", "slow", "hang", "crash", "master", "agent"], kinds


def test_a_node_turned_slow_at_a_restart_in_place_is_still_found(tmp_path: Path) -> None:
    kinds = soaked(tmp_path, "--faults", "1", "--seed", "1", "--kinds", "restart-slow",
                   "--spares", "1")  # fmt: skip
    assert kinds == ["restart-slow"], kinds


def test_a_node_turned_slow_at_a_restart_a_new_leader_carried_out_is_still_found(
    tmp_path: Path,
) -> None:
    kinds = soaked(tmp_path, "--faults", "1", "--seed", "1", "--kinds", "takeover-slow",
                   "--masters", "2", "--spares", "1")  # fmt: skip
    assert kinds == ["takeover-slow"], kinds
