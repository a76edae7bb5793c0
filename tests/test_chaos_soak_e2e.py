"""A short chaos soak on the emulated cluster (``benchmarks/chaos_soak.py``, seed 3: a training
SIGKILLed, a node that loses every process, two agents SIGKILLed, another node lost): the run
exits 0, every fault is counted once and none is taken for a hang, each recovery restarts every
rank from the step the master named with that step's values, and nothing is left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import require_namespaces

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SOAK = Path(__file__).parent.parent / "benchmarks" / "chaos_soak.py"


def test_five_faults_of_three_kinds_in_one_job_leave_it_whole(tmp_path: Path) -> None:
    require_namespaces()
    argv = [sys.executable, str(SOAK), "--faults", "5", "--seed", "3", "--work", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=840, check=False)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    kinds = [line.split()[2] for line in said.splitlines() if line.startswith("fault ")]
    assert sorted(set(kinds)) == ["agent", "crash", "node"], said
    assert "chaos soak: passed" in said, said
