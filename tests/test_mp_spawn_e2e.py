"""End to end: a job in the shape of PyTorch's DDP tutorial (``mp.spawn`` starts the ranks in one
pod; no torchrun, no aegis import) under ``aegis run``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.platforms import local_run
from aegis.platforms.local import session_members

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

SCRIPT = Path(__file__).parent / "bin" / "mp_spawn_ddp.py"


async def test_a_rank_that_raises_under_mp_spawn_restarts_in_place_and_is_named(
    tmp_path: Path,
) -> None:
    """Rank 1 raises: mp.spawn's parent raises ProcessRaisedException. The fault is a software
    one, restarted in place at once without checks, and its reason names rank 1's own error, not
    the wrapper alone; every rank resumes from the tutorial's own checkpoint."""
    command = (sys.executable, str(SCRIPT), str(tmp_path / "ckpt"), "--steps", "30",
               "--crash-rank", "1", "--crash-at-step", "12")  # fmt: skip
    settings = local_run.RunSettings(
        command=command, nodes=1, spare_nodes=0, max_retry=2, job="mp",
        heartbeat_timeout_s=10.0, grace_s=3.0, log_dir=tmp_path / "logs",
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert result.status.recover_count == 1
    events = [json.loads(line) for line in (result.log_dir / "events.jsonl").open()]
    assert not any(e.get("phase") == "Troubleshooting" for e in events)  # no checks run
    [error] = [e["data"] for e in events if e.get("type") == "Error"]
    assert error["fault_class"] == "python_traceback"
    assert error["reason"] == (
        "uncaught torch.multiprocessing.spawn.ProcessRaisedException: RuntimeError: injected "
        "crash in rank 1 (reported as the process exits)"
    )
    log = (result.log_dir / "pods" / "mp-0.log").read_text()
    resumed = re.findall(r"rank (\d) starts at (\d+) \(restart 1\)", log)
    assert sorted(rank for rank, _ in resumed) == ["0", "1"], log
    assert {int(step) for _, step in resumed} == {10}, log  # rank 0's save of step 10
    [agent] = result.agent_pids_seen["mp-0"]
    assert session_members(agent) == []
