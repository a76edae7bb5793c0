"""Torch distributed checkpoints through Aegis: an FSDP2 model on 2 gloo ranks (real processes,
real saver daemons, real files), saved with ``aegis.checkpoint.dcp.Writer`` and loaded with
``Reader``, interchangeable with DCP's own ``FileSystemWriter`` / ``FileSystemReader``.

Starting torch in a rank is the cost here, so one scenario (three runs of the ranks) makes every
checkpoint the tests look at: run 1 trains, saves (``dcp.save`` then ``dcp.async_save``) and
loads right away, and saves and loads with DCP's writer; run 2 is an in-place restart (new
processes, the pods' shared memory kept) with the disk copy out of reach; run 3 is a replacement
on another node with another world size (no shared memory) after a shard of the newest step
was corrupted.
"""

from __future__ import annotations

import asyncio
import io
import json
import pickle
import shutil
import struct
import subprocess
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aegis.checkpoint import process
from tests import gloo_ranks
from tests.agent_waits import BIN
from tests.waits import wait_until

WORKER = BIN / "dcp_fsdp.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the scenario runs 3 times 2 ranks


@dataclass
class Scenario:
    tmp: Path
    shms: list[Path]
    tails: list[process.DaemonProcess] = field(default_factory=list)  # commits.jsonl readers
    logs: str = ""
    restart_left_disk_alone: bool = False

    @property
    def root(self) -> Path:
        return self.tmp / "dcp"

    def run(self, *actions: str, shms: list[Path]) -> None:
        """Run ``dcp_fsdp.py ACTIONS`` on ``len(shms)`` ranks (rank r on shared memory shms[r])."""
        self.logs += gloo_ranks.run_ranks(WORKER, list(actions), shms, self.root, self.tmp, "run")

    def committed(self) -> list[int | None]:
        for tail in self.tails:
            asyncio.run(tail.poll_commits())
        return [tail.last_committed for tail in self.tails]

    def report(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.tmp / name).read_text())
        return data


def _shms(n: int) -> list[Path]:
    return [Path("/dev/shm") / f"aegis-test-dcp-{uuid.uuid4().hex[:8]}" for _ in range(n)]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("dcp")
    pods, replacement = _shms(2), _shms(1)
    daemons = []
    sc = Scenario(tmp, pods)
    try:
        for i, shm in enumerate(pods):
            settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=tmp / f"pod{i}")
            daemons.append(subprocess.Popen(settings.argv(), stderr=subprocess.DEVNULL))
            sc.tails.append(process.DaemonProcess(settings))
        sc.run("train", "save:expect=step1.pt", "train", "save:async=1,expect=step2.pt",
               "load:expect=step2.pt,report=after_save.json",
               f"save:writer=fs,id={tmp / 'theirs'},expect=theirs.pt",
               f"load:id={tmp / 'theirs'},expect=theirs.pt,report=theirs.json",
               shms=pods)  # fmt: skip
        wait_until(lambda: sc.committed() == [2, 2], 60.0, "step 2 committed by both pods")
        hidden = tmp / "out-of-reach"
        sc.root.rename(hidden)  # the in-place restart must not need a file of the disk copy
        sc.run("load:expect=step2.pt,report=restart.json", shms=pods)
        sc.restart_left_disk_alone = not sc.root.exists()
        hidden.rename(sc.root)
        flip_a_data_byte(sc.root / "step-2", shard_files(sc.root / "step-2")[0])
        sc.run("load:expect=step1.pt,report=fallback.json",
               f"load:reader=fs,id={sc.root / 'step-1'},expect=step1.pt,report=fs.json",
               shms=replacement)  # fmt: skip
        yield sc
    finally:
        for d in daemons:
            d.kill()
            d.wait()
        for shm in pods + replacement:
            shutil.rmtree(shm, ignore_errors=True)


def test_dcp_load_right_after_save_and_async_save_reads_shm_when_fsdp2_runs_on_two_ranks(
    scenario: Scenario,
) -> None:
    assert scenario.report("after_save.json") == {
        "differences": [], "step": 2, "source": "shm", "world": 2}  # fmt: skip


def test_dcp_steps_are_committed_by_every_pod_in_dcp_format_when_daemons_persist(
    scenario: Scenario,
) -> None:
    assert scenario.committed() == [2, 2]  # what the agent tails and reports to the master
    saves = []
    for step in (1, 2):
        every = sorted(p.name for p in (scenario.root / f"step-{step}").iterdir())
        names = [n for n in every if not n.endswith(".crc32")]
        assert every == sorted([*names, ".metadata.crc32"])  # the metadata with its CRC32
        assert names[0] == ".metadata" and len(names) == 3, names
        (save,) = {name.removesuffix(".distcp").split("_")[-1] for name in names[1:]}
        assert names[1:] == [f"__0_{save}.distcp", f"__1_{save}.distcp"]
        assert shard_files(scenario.root / f"step-{step}") == names[1:]
        saves.append(save)
    assert saves[0] != saves[1]  # each save names its own files


def test_dcp_aegis_checkpoint_loads_with_filesystem_reader_when_read_by_dcp_alone(
    scenario: Scenario,
) -> None:
    assert scenario.report("fs.json") == {
        "differences": [], "step": None, "source": None, "world": 1}  # fmt: skip


def test_dcp_filesystem_writer_checkpoint_loads_with_aegis_reader_when_given_its_directory(
    scenario: Scenario,
) -> None:
    assert scenario.report("theirs.json")["differences"] == []


def test_dcp_load_after_in_place_restart_comes_from_shm_when_disk_copy_is_out_of_reach(
    scenario: Scenario,
) -> None:
    assert scenario.report("restart.json") == {
        "differences": [], "step": 2, "source": "shm", "world": 2}  # fmt: skip
    assert scenario.restart_left_disk_alone


def test_dcp_load_falls_back_to_previous_step_and_reshards_when_newest_shard_is_corrupt(
    scenario: Scenario,
) -> None:
    assert scenario.report("fallback.json") == {
        "differences": [], "step": 1, "source": "disk", "world": 1}  # fmt: skip
    shard = shard_files(scenario.root / "step-2")[0]
    assert f"DCP checkpoint step 2 skipped: {shard}: checksum mismatch" in scenario.logs


def storage_infos(where: Path) -> list[Any]:
    """Where ``.metadata`` says each item is (file, offset, length)."""
    import torch  # noqa: F401  (the metadata pickle holds torch types)

    with (where / ".metadata").open("rb") as src:
        meta = pickle.load(src)
    return list(meta.storage_data.values())


def shard_files(where: Path) -> list[str]:
    """The files ``.metadata`` names, rank 0's first."""
    return sorted({i.relative_path for i in storage_infos(where)})


def flip_a_data_byte(where: Path, name: str) -> None:
    """Flip one byte in the middle of the largest tensor's data (``data/0``) in file ``name``."""
    info = max((i for i in storage_infos(where) if i.relative_path == name),
               key=lambda i: i.length)  # fmt: skip
    path = where / name
    raw = bytearray(path.read_bytes())
    item = bytes(raw[info.offset : info.offset + info.length])
    member = next(z for z in zipfile.ZipFile(io.BytesIO(item)).infolist()
                  if z.filename.endswith("/data/0"))  # fmt: skip
    name_len, extra_len = struct.unpack_from("<HH", item, member.header_offset + 26)
    data_at = info.offset + member.header_offset + 30 + name_len + extra_len
    raw[data_at + member.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
