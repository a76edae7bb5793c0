"""A damaged newest DCP checkpoint on disk: ``aegis.checkpoint.dcp.Reader`` skips it, with a
warning, and loads the step before, whatever the damage makes unpickling or unzipping raise.

Real saves (``dcp.save`` with Aegis's ``Writer``, committed to disk as the saver daemon does),
one bit or a half of one file of the newest step damaged, loaded by a fresh node (no shared
memory) in one process.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from aegis.checkpoint import daemon
from aegis.checkpoint.dcp import Reader, Writer

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


@pytest.mark.parametrize(
    ("target", "damage"),
    [(".metadata", _class_name), (".metadata", _module_name), (".metadata", _truncated),
     ("shard", _zip_signature), ("shard", _central_flags), ("shard", _central_size)],
)  # fmt: skip
def test_dcp_load_falls_back_to_previous_step_when_newest_step_has_a_damaged_file(
    saved: Path, target: str, damage: Callable[[bytearray], None], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    root = tmp_path / "dcp"
    shutil.copytree(saved / "dcp", root)
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
