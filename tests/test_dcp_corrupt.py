"""A damaged newest DCP checkpoint on disk: ``aegis.checkpoint.dcp.Reader`` skips it, with a
warning, and loads the step before, whatever the damage makes unpickling or unzipping raise.

Real saves (``dcp.save`` with Aegis's ``Writer``, committed to disk as the saver daemon does),
one bit or a half of one file of the newest step damaged (with the CRC32 sidecar the writer
leaves beside ``.metadata``, and without it as older checkpoints are), loaded by a fresh node
(no shared memory): in one process, and on two gloo ranks (real processes) where only one rank
checks the damaged file and both must still agree on the step before.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from aegis.checkpoint import daemon
from aegis.checkpoint.dcp import Reader, Writer
from tests import gloo_ranks
from tests.agent_waits import BIN

RANK = BIN / "dcp_corrupt_rank.py"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(8.0) * step, "n": step}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 saved and committed; step 2's pristine files kept aside."""
    tmp = tmp_path_factory.mktemp("dcp-corrupt")
    env = {"AEGIS_CKPT_SHM": str(tmp / "shm"), "AEGIS_DCP_DIR": str(tmp / "dcp")}
    for step in (1, 2):
        dcp.save(_state(step), storage_writer=Writer(environ=env), checkpoint_id=step)
        daemon.commit_one(tmp / "shm", tmp / "ckpt", step, 0, 3)
    shutil.copytree(tmp / "dcp" / "step-2", tmp / "pristine")
    shutil.rmtree(tmp / "shm")
    return tmp


def _class_name(b: bytearray) -> None:  # unpickling raises AttributeError
    at = b.index(b"TensorProperties")
    b[at + 3] ^= 0x20


def _module_name(b: bytearray) -> None:  # unpickling raises ModuleNotFoundError
    at = b.index(b"torch.distributed.checkpoint.metadata")
    b[at + 1] ^= 0x20


def _truncated(b: bytearray) -> None:  # unpickling raises UnpicklingError
    del b[len(b) // 2 :]


def _zip_signature(b: bytearray) -> None:  # the item no longer starts as a zip
    b[0] ^= 1


def _central_flags(b: bytearray) -> None:  # "encrypted": zipfile raises RuntimeError
    b[b.index(b"PK\x01\x02") + 8] ^= 1


def _central_size(b: bytearray) -> None:  # zipfile reads it; torch.load does not
    b[b.index(b"PK\x01\x02") + 20] ^= 1


def _field_name(b: bytearray) -> None:  # unpickles, without a field the load reads
    at = b.index(b"offsets")
    b[at] ^= 0x20


DAMAGES = [
    (".metadata", _class_name), (".metadata", _module_name), (".metadata", _truncated),
    ("shard", _zip_signature), ("shard", _central_flags), ("shard", _central_size),
]  # fmt: skip


@pytest.mark.parametrize(
    ("crcs", "target", "damage"),
    [*((True, t, d) for t, d in [*DAMAGES, (".metadata", _field_name)]),
     *((False, t, d) for t, d in DAMAGES)],  # a checkpoint written before the CRC32 sidecars
)  # fmt: skip
def test_dcp_load_falls_back_to_previous_step_when_newest_step_has_a_damaged_file(
    saved: Path, crcs: bool, target: str, damage: Callable[[bytearray], None], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    root = tmp_path / "dcp"
    shutil.copytree(saved / "dcp", root)
    sidecars = sorted(root.glob("step-*/*.crc32"))
    assert [p.name for p in sidecars] == [".metadata.crc32"] * 2  # in each step
    for sidecar in sidecars if not crcs else []:
        sidecar.unlink()
    (shard,) = (p.name for p in (saved / "pristine").iterdir() if p.suffix == ".distcp")
    path = root / "step-2" / (shard if target == "shard" else target)
    raw = bytearray(path.read_bytes())
    damage(raw)
    path.write_bytes(bytes(raw))
    state = {"w": torch.zeros(8), "n": 0}
    reader = Reader(environ={"AEGIS_CKPT_SHM": str(tmp_path / "shm"), "AEGIS_DCP_DIR": str(root)})
    with caplog.at_level(logging.WARNING, logger="aegis.checkpoint.dcp.reader"):
        dcp.load(state, storage_reader=reader)
    assert (reader.step, reader.source, state["n"]) == (1, "disk", 1)
    assert torch.equal(state["w"], torch.arange(8.0))
    assert "DCP checkpoint step 2 skipped" in caplog.text


def _run_ranks(tmp: Path, name: str, argv: list[str], shms: list[Path]) -> None:
    """Run ``dcp_corrupt_rank.py ARGV`` (``{rank}`` filled in) on len(shms) gloo ranks."""
    gloo_ranks.run_ranks(RANK, argv, shms, tmp / "dcp", tmp, name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dcp_load_on_two_ranks_falls_back_together_when_a_shard_only_rank_1_checks_is_damaged(
    tmp_path: Path,
) -> None:
    """Rank 1 checks the second file: the damage makes zipfile raise there, and rank 1 must
    still reach the collective in which rank 0 waits for its verdict (the data files have no
    CRC32 sidecar: their items' own CRCs are checked)."""
    pods = [tmp_path / "pod0", tmp_path / "pod1"]
    _run_ranks(tmp_path, "save", ["save", str(tmp_path / "ckpt{rank}")], pods)
    step2 = tmp_path / "dcp" / "step-2"
    for sidecar in step2.glob("*.crc32"):
        sidecar.unlink()
    second = sorted(p for p in step2.iterdir() if p.suffix == ".distcp")[1]
    raw = bytearray(second.read_bytes())
    _central_flags(raw)
    second.write_bytes(bytes(raw))
    fresh = [tmp_path / "fresh0", tmp_path / "fresh1"]
    _run_ranks(tmp_path, "load", ["load", str(tmp_path / "report{rank}.json")], fresh)
    reports = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    expected = {"step": 1, "source": "disk", "w": [0.0, 1.0, 2.0, 3.0]}
    assert reports == [expected, expected]
    assert f"DCP checkpoint step 2 skipped: {second.name}: RuntimeError" in (
        tmp_path / "load-rank0.log").read_text()  # fmt: skip
