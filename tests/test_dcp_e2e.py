"""A plain DCP script under ``aegis run`` (real agents, master, saver daemons): a rank killed
mid-training, every rank restarted in place and restored from shared memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.platforms import local_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(280)]


async def test_dcp_script_killed_mid_training_resumes_from_shared_memory_when_run_by_aegis(
    tmp_path: Path,
) -> None:
    """Rank 1 dies at step 5; both ranks restart in place and ``dcp.load`` with Aegis's Reader
    restores the checkpoint of step 4 (or 2) from shared memory, no durable file opened, though
    the checkpoints are committed on disk in DCP's format and reach the master as commits."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    settings = local_run.RunSettings(
        command=(sys.executable, str(Path(__file__).parent / "bin" / "dcp_resume.py"),
                 str(out), str(ckpt)),
        nodes=2, spare_nodes=0, max_retry=1, job="dcp", grace_s=2.0, log_dir=tmp_path / "logs",
        ckpt_dir=ckpt,
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert result.status.recover_count == 1
    for rank in ("0", "1"):
        first, second = map(json.loads, (out / f"rank-{rank}.jsonl").read_text().splitlines())
        assert first["incarnation"] == 0 and first["resumed_from"] == 0
        assert second["incarnation"] == 1 and second["source"] == "shm", second
        assert second["opened"] == [], second
        assert second["resumed_from"] in (2, 4) and second["found"] == second["resumed_from"]
    steps = sorted(p.name for p in (ckpt / "dcp").iterdir())
    assert "step-3" in steps, steps  # the save at step 6, after the restart, made checkpoint 3
    assert (ckpt / "dcp" / "step-3" / ".metadata").exists()
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").open()]
    commits = [e["step"] for e in events if e.get("type") == "CheckpointCommitted"]
    assert commits and commits[-1] == 3, commits  # the master's safe points saw DCP's commits
