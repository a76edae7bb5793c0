"""The training-side checkpoint API against a real saver daemon process."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import aegis.checkpoint
from aegis.checkpoint import api, process
from aegis.checkpoint import layout as lay
from tests.waits import async_wait_until

PY = sys.executable


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"aegis-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(shm: Path, tmp_path: Path) -> AsyncIterator[process.DaemonProcess]:
    proc = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt"))
    await proc.start()
    yield proc
    await proc.stop()


async def committed(daemon: process.DaemonProcess, step: int) -> None:
    async def check() -> bool:
        await daemon.poll_commits()
        return daemon.last_committed is not None and daemon.last_committed >= step

    await async_wait_until(check, what=f"step {step} committed", seen=lambda: daemon.last_committed)


def training_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "extra": [torch.arange(5, dtype=torch.int64), ("tag", 1.5), torch.tensor(True)],
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


async def test_saver_round_trips_model_and_optimizer_when_committed(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    settings = api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt")
    state = training_state(1)
    api.Saver(settings).save(3, state)
    await committed(daemon, 3)
    assert (tmp_path / "ckpt" / "step-3" / "COMMIT").is_file()
    from_shm = api.Saver(settings).load_latest()
    assert from_shm is not None and from_shm[0] == 3
    assert_same(state, from_shm[1])
    from_disk = api.Saver(settings).load_from_disk()
    assert from_disk is not None and from_disk[0] == 3
    assert_same(state, from_disk[1])
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    model.load_state_dict(from_disk[1]["model"])


async def test_load_copies_into_template_and_never_aliases_shm_when_saving_again(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt"))
    saver.save(1, {"w": torch.full((256,), 1.0), "b": torch.zeros(3)})
    await committed(daemon, 1)
    template = {"w": torch.empty(256), "b": torch.empty(3, dtype=torch.float64)}
    loaded = api.Saver(saver.settings).load_latest(template)
    assert loaded is not None
    state = loaded[1]
    assert state["w"].data_ptr() == template["w"].data_ptr() and float(state["w"][0]) == 1.0
    assert state["b"].dtype == torch.float64  # moved to the template's dtype
    plain = api.Saver(saver.settings).load_latest()
    assert plain is not None
    for step in (2, 3):  # both buffers are overwritten; what was loaded must not change
        saver.save(step, {"w": torch.full((256,), float(step)), "b": torch.ones(3)})
        await committed(daemon, step)
    assert float(plain[1]["w"].sum()) == 256.0 and float(state["w"].sum()) == 256.0


async def test_saver_alternates_buffers_and_keeps_newest_when_saving_repeatedly(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt"))
    for step in range(1, 6):
        saver.save(step, {"w": torch.full((1000,), float(step))})  # waits for the previous one
    await committed(daemon, 5)
    loaded = api.Saver(saver.settings).load_latest()
    assert loaded is not None and loaded[0] == 5 and float(loaded[1]["w"][0]) == 5.0
    assert saver.committed_steps() == [4, 5]  # the previous one stays whole in the other buffer
    earlier = api.Saver(replace(saver.settings, resume_step=4)).load_latest()
    assert earlier is not None and earlier[0] == 4 and float(earlier[1]["w"][0]) == 4.0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-3", "step-4", "step-5"]


async def test_a_step_saved_again_after_a_rollback_is_persisted_and_reported_anew(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    """A rank saved 2, 4, 6, then the job rolled back to 4 (its peers had 4): it resumes from
    4 in shared memory and saves 6 again with new values. That 6 is persisted (disk holds the
    new values), reported again, and no marker of the abandoned timeline is left behind."""
    ckpt = tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    for step in (2, 4, 6):
        saver.save(step, {"w": torch.full((1000,), float(step))})
    await committed(daemon, 6)
    resumed = api.Saver(replace(saver.settings, resume_step=4))
    loaded = resumed.load_latest()
    assert loaded is not None and loaded[0] == 4
    resumed.save(6, {"w": torch.full((1000,), 66.0)})
    reported: list[int] = []

    async def recommitted() -> bool:  # a new line: reported although 6 was before
        reported.extend(await daemon.poll_commits())
        return bool(reported)

    await async_wait_until(recommitted, 30, "the new step 6 reported")
    assert reported == [6]
    from_disk = api.Saver(api.SaverSettings(shm_dir=tmp_path / "none", ckpt_dir=ckpt))
    on_disk = from_disk.load_latest()
    assert on_disk is not None and on_disk[0] == 6 and float(on_disk[1]["w"][0]) == 66.0
    markers = sorted(p.name for p in shm.glob("committed-*"))
    assert markers == ["committed-4", "committed-6"]


def test_saver_raises_busy_when_previous_save_is_not_persisted(shm: Path, tmp_path: Path) -> None:
    settings = api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path, policy=api.BusyPolicy.RAISE)
    saver = api.Saver(settings)
    saver.save(1, {"w": torch.ones(3)})  # no daemon: step 1 stays pending
    with pytest.raises(api.SaverBusyError, match=r"step 2 not saved: step\(s\) \[1\]"):
        saver.save(2, {"w": torch.ones(3)})
    waiting = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path, wait_timeout_s=0.05))
    with pytest.raises(api.SaverBusyError):
        waiting.save(2, {"w": torch.ones(3)})


def load_from_disk(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> tuple[Any, list[str]]:
    """What a fresh saver (no shared memory: a pod on a new node) loads from ``tmp_path/ckpt``,
    and the warnings it gave."""
    fresh = api.Saver(api.SaverSettings(shm_dir=tmp_path / "empty-shm", ckpt_dir=tmp_path / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="aegis.checkpoint.api"):
        loaded = fresh.load_latest()
    return loaded, [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


async def test_loader_falls_back_to_previous_with_warning_when_committed_copy_is_corrupt(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    saver.save(1, {"w": torch.full((4096,), 1.0)})
    saver.save(2, {"w": torch.full((4096,), 2.0)})
    saver.save(3, {"w": torch.full((4096,), 3.0)})
    await committed(daemon, 3)
    data = ckpt / "step-3" / "data.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    (ckpt / "step-2" / "COMMIT").unlink()  # a torn copy: never loaded
    loaded, warnings = load_from_disk(tmp_path, caplog)
    assert loaded is not None and loaded[0] == 1 and float(loaded[1]["w"][0]) == 1.0
    assert any("step 3 skipped: checksum mismatch" in w for w in warnings), warnings
    assert any("step 2 skipped: no commit marker" in w for w in warnings), warnings


def test_import_of_checkpoint_api_does_not_import_torch_when_imported() -> None:
    code = "import sys, aegis.checkpoint; print('torch' in sys.modules)"
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_load_puts_nested_tensors_in_the_template_when_read_from_disk_or_shm(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    settings = api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt")
    state = {
        "layers": [torch.full((4,), 1.0), (torch.arange(3), "name")],
        "opt": {"m": torch.full((2, 2), 2.0)},
    }
    api.Saver(settings).save(1, state)
    await committed(daemon, 1)
    for load in ("load_latest", "load_from_disk"):
        template = {
            "layers": [torch.empty(4), (torch.empty(3, dtype=torch.int32), None)],
            "opt": {"m": torch.empty(4)},  # another shape: a new tensor, not this one
        }
        loaded = getattr(api.Saver(settings), load)(template)
        assert loaded is not None and loaded[0] == 1
        got = loaded[1]
        assert got["layers"][0].data_ptr() == template["layers"][0].data_ptr(), load
        assert float(got["layers"][0].sum()) == 4.0
        assert got["layers"][1][0].dtype == torch.int32  # moved to the template's dtype
        assert got["layers"][1][0].tolist() == [0, 1, 2] and got["layers"][1][1] == "name"
        assert got["opt"]["m"].shape == (2, 2) and float(got["opt"]["m"].sum()) == 8.0


@dataclass(frozen=True)
class Tag:  # a class of the training's own in its state
    name: str


class Mkdir:
    """Pickles as ``os.mkdir(path)``: what a hostile meta.pkl would hold."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.path),)


async def test_a_state_with_a_class_not_allowed_fails_at_its_first_save_and_loads_once_allowed(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess
) -> None:
    settings = api.SaverSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt")
    state = {"w": torch.ones(3), "tag": Tag("run-1")}
    with pytest.raises(aegis.checkpoint.UnsafeCheckpointError, match=r"\.Tag is not allowed"):
        api.Saver(settings).save(1, state)
    assert not shm.exists() or not list(shm.glob("slot-*"))  # nothing handed off
    with torch.serialization.safe_globals([Tag]):
        api.Saver(settings).save(1, state)
        await committed(daemon, 1)
        for load in ("load_latest", "load_from_disk"):
            loaded = getattr(api.Saver(settings), load)()
            assert loaded is not None and loaded[1]["tag"] == Tag("run-1"), load


def plant(ckpt: Path, step: int, payload: Any) -> None:
    """Replace the step's meta.pkl with ``payload`` pickled, its checksums made to fit (as
    anyone who can write to the directory can)."""
    where = ckpt / f"step-{step}"
    blob = pickle.dumps(payload, protocol=5)
    (where / "meta.pkl").write_bytes(blob)
    manifest = json.loads((where / "manifest.json").read_bytes())
    manifest["meta_crc32"] = zlib.crc32(blob)
    manifest_bytes = json.dumps(manifest).encode()
    (where / "manifest.json").write_bytes(manifest_bytes)
    marker = json.loads((where / "COMMIT").read_bytes())
    marker["manifest_crc32"] = zlib.crc32(manifest_bytes)
    (where / "COMMIT").write_bytes(json.dumps(marker).encode())


async def test_a_planted_meta_pkl_is_skipped_for_the_copy_before_and_never_run(
    shm: Path, tmp_path: Path, daemon: process.DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, made = tmp_path / "ckpt", tmp_path / "made"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    saver.save(1, {"w": torch.full((8,), 1.0)})
    saver.save(2, {"w": torch.full((8,), 2.0)})
    await committed(daemon, 2)
    plant(ckpt, 2, {"w": lay.TensorRef(0), "x": Mkdir(made)})
    loaded, warnings = load_from_disk(tmp_path, caplog)
    assert loaded is not None and loaded[0] == 1 and float(loaded[1]["w"][0]) == 1.0
    assert any("step 2 skipped: posix.mkdir is not allowed" in w for w in warnings), warnings
    plant(ckpt, 1, Mkdir(made))
    with pytest.raises(aegis.checkpoint.UnsafeCheckpointError, match=r"posix\.mkdir"):
        load_from_disk(tmp_path, caplog)  # copies there, none allowed: no fresh start
    assert not made.exists()
