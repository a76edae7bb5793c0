"""Several ranks in one pod (``torchrun --nproc-per-node 2`` under one agent) with Aegis's
checkpoints, ``aegis.checkpoint`` and DCP alike: each local rank saves into slots of its own in
the pod's shared memory (``local-<k>/``) and its own directory on disk, and a step is the pod's
commit (what the master has every rank resume from) once both ranks have committed it.

Before, both ranks of a pod wrote the same buffers and slot files: a rank resumed from its
peer's tensors, a DCP load read a torn mix (a step counter of 4344031699813285785 on a GPU
machine), and the second save waited on the peer's slot until the hang watchdog fired.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.platforms import local_run
from tests.jsonl import json_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BIN = Path(__file__).parent / "bin"


def _torchrun(script: str, *args: str) -> tuple[str, ...]:
    """``script`` (under tests/bin unless a path) on two ranks of one pod."""
    return (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            str(BIN / script), *args)  # fmt: skip


async def _run(tmp_path: Path, command: tuple[str, ...]) -> local_run.RunResult:
    settings = local_run.RunSettings(
        command=command, nodes=1, spare_nodes=0, max_retry=1, job="two", grace_s=2.0,
        log_dir=tmp_path / "logs", ckpt_dir=tmp_path / "ckpt", heartbeat_timeout_s=10.0,
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert result.status.recover_count == 1, result.log_dir
    return result


async def test_two_ranks_of_one_pod_resume_each_its_own_checkpoint_from_shared_memory(
    tmp_path: Path,
) -> None:
    """``aegis.checkpoint.save``/``load_latest``: each rank saves step + 1000 x rank; after rank
    1 died at step 5 both resume, without a disk read, from the step the master said (the
    pod's commit), each with its own tensor. Each has its own copies on disk."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    await _run(tmp_path, _torchrun("ckpt_resume.py", str(out), str(ckpt)))
    resumed = set()
    for rank in ("0", "1"):
        first, second = json_lines(out / f"rank-{rank}.jsonl")
        assert first["incarnation"] == 0 and first["resumed_from"] == 0
        assert second["incarnation"] == 1 and second["opened"] == [], second
        assert second["resumed_from"] in (2, 4), second
        assert second["found"] == second["resumed_from"], second  # its own, not its peer's
        assert second["resume_step"] == str(second["resumed_from"]), second
        resumed.add(second["resumed_from"])
    assert len(resumed) == 1  # both from the same step
    for local in ("local-0", "local-1"):
        committed = sorted(p.parent.name for p in (ckpt / "two-0" / local).glob("step-*/COMMIT"))
        assert "step-6" in committed, (local, committed)
    assert not list((ckpt / "two-0").glob("step-*"))  # nothing in the pod's own directory


async def test_two_ranks_of_one_pod_load_a_dcp_checkpoint_from_their_shared_memory(
    tmp_path: Path,
) -> None:
    """``dcp.save``/``dcp.load`` with Aegis's writer and reader: both ranks resume from shared
    memory with the value they saved, and each DCP save on disk (two before the crash, one
    after) has both ranks' files."""
    out = tmp_path / "out"
    out.mkdir()
    await _run(tmp_path, _torchrun("dcp_resume.py", str(out), str(tmp_path / "ckpt")))
    resumed = set()
    for rank in ("0", "1"):
        first, second = json_lines(out / f"rank-{rank}.jsonl")
        assert first["incarnation"] == 0 and first["resumed_from"] == 0
        assert second["incarnation"] == 1 and second["source"] == "shm", second
        assert second["resumed_from"] in (2, 4), second
        assert second["found"] == second["resumed_from"] and second["opened"] == [], second
        resumed.add(second["resumed_from"])
    assert len(resumed) == 1
    saves = sorted((tmp_path / "ckpt" / "dcp").glob("step-*"), key=lambda p: int(p.name[5:]))
    assert [p.name for p in saves] == ["step-1", "step-2", "step-3"]  # DCP numbers its saves
    for save in saves:
        every = sorted(p.name for p in save.iterdir())
        names = [name for name in every if not name.endswith(".crc32")]
        assert names[0] == ".metadata" and len(names) == 3, names
        assert names[1].startswith("__0_") and names[2].startswith("__1_"), names
        assert every == sorted([*names, ".metadata.crc32"])  # the metadata checked


async def test_a_plain_exception_of_one_rank_under_torchrun_restarts_the_pod_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1 of ``torchrun --nproc-per-node 2`` raises: its peer's broken connection does not
    make it a ``connection`` fault, so no check round runs (a software fault, restarted in place
    at once), and both ranks resume from the same step of their own Aegis checkpoint."""
    train = Path(__file__).parent.parent / "examples" / "train_ddp.py"
    crash = ("--crash-at-step", "12", "--crash-rank", "1", "--ckpt-dir", str(tmp_path / "plain"))
    command = _torchrun(str(train), "--steps", "30", "--ckpt-every", "5", *crash)
    result = await _run(tmp_path, command)
    events = [json.loads(line) for line in (result.log_dir / "events.jsonl").open()]
    errors = [e["data"]["fault_class"] for e in events if e.get("type") == "Error"]
    assert errors == ["python_traceback"], errors
    assert not any(e.get("phase") == "Troubleshooting" for e in events)
    log = (result.log_dir / "pods" / "two-0.log").read_text()
    said = r"rank=(\d) resumed from aegis checkpoint at step (\d+) \(incarnation 1"
    resumed = re.findall(said, log)
    assert sorted(resumed) in ([("0", "5"), ("1", "5")], [("0", "10"), ("1", "10")]), resumed
