"""The saver daemon on a durable directory that fills up or turns read-only (a real tmpfs):
the failure is recorded at once and once per outage, saves go on from shared memory, the
newest save is persisted when the store works again, and every committed step loads."""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
import subprocess
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from aegis.checkpoint import api, outage, process, store
from aegis.checkpoint import layout as lay
from tests.waits import async_wait_until

N = 16 * 1024  # 64 KiB of float32 per save


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"aegis-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted at the end whatever happened."""
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                          check=False, capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


class Watched:
    """A supervised daemon and what it reported: commits and store reports, in order."""

    def __init__(self, settings: process.DaemonSettings) -> None:
        self.commits: list[int] = []
        self.reports: list[outage.StoreReport] = []
        self.daemon = process.DaemonProcess(settings, on_commit=self._commit, on_store=self._store)

    async def _commit(self, step: int) -> None:
        self.commits.append(step)

    async def _store(self, report: outage.StoreReport) -> None:
        self.reports.append(report)

    def failures(self) -> int:
        return sum(r.failures for r in self.reports if not r.ok)


@pytest.fixture
async def watched(shm: Path, disk: Path) -> AsyncIterator[Watched]:
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=disk / "pod-0", keep=2)
    w = Watched(settings)
    task = asyncio.create_task(w.daemon.supervise(), name="test-daemon")
    try:
        yield w
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def fill(where: Path) -> Path:
    filler = where / "filler"
    with filler.open("wb", buffering=0) as out, pytest.raises(OSError) as caught:
        while True:
            out.write(b"\0" * 4096)
    assert caught.value.errno == errno.ENOSPC
    return filler


async def save(saver: api.Saver, step: int) -> None:
    """A save from a thread: one that blocks fails the test instead of hanging it."""
    async with asyncio.timeout(30.0):
        await asyncio.to_thread(saver.save, step, {"w": torch.full((N,), float(step))})


def every_committed_step_loads(ckpt: Path) -> list[int]:
    loaded = []
    for step in lay.disk_steps(ckpt):
        if (lay.step_dir(ckpt, step) / lay.COMMIT).exists():
            copy = store.read_committed(ckpt, step)
            values = torch.frombuffer(copy.data, dtype=torch.float32)
            assert bool((values[:N] == float(step)).all()), f"step {step} holds other values"
            loaded.append(step)
    return loaded


async def test_full_store_is_reported_once_saves_go_on_and_the_newest_persists_when_space_returns(
    shm: Path, disk: Path, watched: Watched
) -> None:
    ckpt = disk / "pod-0"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt, policy=api.BusyPolicy.WAIT))
    await save(saver, 10)
    await async_wait_until(lambda: watched.commits == [10])
    filler = fill(disk)
    await save(saver, 20)
    await async_wait_until(lambda: any(r.opened for r in watched.reports))
    opened = watched.reports[0]
    assert (opened.errno, opened.step, opened.directory) == (errno.ENOSPC, 20, str(ckpt))
    assert opened.strerror == "No space left on device"
    assert saver.store_down()
    for step in (30, 40, 50):  # none of them waits on the slot the daemon cannot persist
        await save(saver, step)
    await async_wait_until(lambda: watched.failures() >= 3)
    assert [r.opened for r in watched.reports if not r.ok].count(True) == 1  # once per outage
    assert saver.committed_steps() == [10]  # the newest committed stays whole for a restart
    assert saver.pending_steps() == [50]  # older unpersisted saves dropped, the newest kept
    loaded = api.Saver(api.SaverSettings(shm_dir=shm)).load_latest()
    assert loaded is not None and loaded[0] == 10 and float(loaded[1]["w"][0]) == 10.0
    assert not list(ckpt.glob(".tmp-step-*"))  # a failed attempt leaves no partial copy
    filler.unlink()
    await async_wait_until(lambda: 50 in watched.commits)
    await async_wait_until(lambda: any(r.ok for r in watched.reports))
    assert watched.commits == [10, 50]  # 20..40 were never committed: no torn one either
    back = watched.reports[-1]
    assert back.ok and back.step == 50 and back.down_s > 0
    assert not saver.store_down()
    assert every_committed_step_loads(ckpt) == [10, 50]
    await save(saver, 60)  # and the next save is persisted as before
    await async_wait_until(lambda: 60 in watched.commits)
    assert every_committed_step_loads(ckpt) == [50, 60]
    from_disk = api.Saver(api.SaverSettings(shm_dir=shm / "none", ckpt_dir=ckpt))
    result = from_disk.load_from_disk()
    assert result is not None and result[0] == 60


async def test_a_store_full_of_held_steps_prunes_once_the_job_moves_on_and_persists_again(
    shm: Path, disk: Path, watched: Watched
) -> None:
    """The job is committed at 10 (another pod's store was down), so this pod holds 10, 20, 30
    and 40 though it keeps two, and then its disk is full. Once the job moves on to 30, the
    failed attempt prunes what is no longer held (10, 20) and the next one commits 50. It
    pruned only after a commit, so the store stayed full and nothing was persisted again."""
    ckpt = disk / "pod-0"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt, policy=api.BusyPolicy.WAIT))

    async def committed(step: int) -> None:
        await async_wait_until(lambda: step in watched.commits, 30, f"step {step} committed")

    lay.hold_from(shm, 10)
    for step in (10, 20, 30, 40):
        await save(saver, step)
        await committed(step)
    assert lay.disk_steps(ckpt) == [10, 20, 30, 40]
    fill(disk)
    lay.hold_from(shm, 30)  # what the agent writes when the master says the job's new step
    await save(saver, 50)
    await committed(50)
    assert [r.opened for r in watched.reports if not r.ok] == [True]  # it was full
    assert every_committed_step_loads(ckpt) == [30, 40, 50]  # 30: held; 40, 50: the newest two


async def test_read_only_store_is_reported_with_erofs_and_persisting_resumes_after_remount(
    shm: Path, disk: Path, watched: Watched
) -> None:
    ckpt = disk / "pod-0"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    await save(saver, 1)
    await async_wait_until(lambda: watched.commits == [1])
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    await save(saver, 2)
    await async_wait_until(lambda: any(r.opened for r in watched.reports))
    assert watched.reports[0].errno == errno.EROFS
    await save(saver, 3)
    subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
    await async_wait_until(lambda: 3 in watched.commits)
    assert watched.commits == [1, 3]
    assert every_committed_step_loads(ckpt) == [1, 3]


async def test_outage_goes_on_across_a_daemon_restart_without_a_second_report(
    shm: Path, disk: Path, watched: Watched
) -> None:
    ckpt = disk / "pod-0"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    await save(saver, 1)
    await async_wait_until(lambda: watched.commits == [1])
    filler = fill(disk)
    await save(saver, 2)
    await async_wait_until(lambda: watched.failures() >= 1)
    await watched.daemon.stop()  # supervise starts it again: the outage is the same one
    await async_wait_until(lambda: watched.daemon.alive and watched.daemon.restarts == 1)
    await async_wait_until(lambda: watched.failures() >= 3)
    assert [r.opened for r in watched.reports].count(True) == 1
    filler.unlink()
    await async_wait_until(lambda: 2 in watched.commits)
    assert every_committed_step_loads(ckpt) == [1, 2]


def test_a_slot_replaced_while_it_is_persisted_is_never_committed(
    shm: Path, tmp_path: Path
) -> None:
    """The save that goes on while the store is down may overwrite the buffer the daemon is
    reading: the copy is removed before its commit marker, and the previous one still loads."""
    ckpt = tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt, policy=api.BusyPolicy.RAISE))
    saver.save(1, {"w": torch.full((N,), 1.0)})
    store.persist(shm, ckpt, 1)
    lay.committed_marker(shm, 1).write_bytes(b"")  # as the daemon does after persisting
    saver.save(2, {"w": torch.full((N,), 2.0)})
    with pytest.raises(store.SlotReplacedError):
        store.persist(shm, ckpt, 2, still_handed=lambda: False)
    assert lay.disk_steps(ckpt) == [1] and not list(ckpt.glob(".tmp-step-*"))
    assert every_committed_step_loads(ckpt) == [1]
    assert store.persist(shm, ckpt, 2, still_handed=lambda: True) == lay.step_dir(ckpt, 2)
    assert every_committed_step_loads(ckpt) == [1, 2]


def test_a_save_of_empty_tensors_only_is_persisted_and_loads(shm: Path, tmp_path: Path) -> None:
    """No data bytes at all (a state of empty tensors, say a model not built yet): the copy
    has a checksum for each tensor and loads (its manifest had none, and reading it raised)."""
    ckpt = tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt, policy=api.BusyPolicy.RAISE))
    saver.save(3, {"w": torch.empty(0), "b": torch.zeros(0, 4)})
    store.persist(shm, ckpt, 3)
    copy = store.read_committed(ckpt, 3)
    assert copy.layout.data_bytes == 0 and len(copy.layout.tensors) == 2 and copy.data == b""
    _rewrite_checksums(lay.step_dir(ckpt, 3), [])  # as older copies wrote it: still loads
    assert store.read_committed(ckpt, 3).layout == copy.layout


def _rewrite_checksums(where: Path, crcs: object) -> None:
    """The manifest of the copy in ``where`` with ``crcs`` as its tensors' checksums, and a
    commit marker that fits it."""
    manifest = json.loads((where / "manifest.json").read_bytes())
    manifest["tensor_crc32"] = crcs
    written = json.dumps(manifest).encode()
    (where / "manifest.json").write_bytes(written)
    step = manifest["step"]
    (where / lay.COMMIT).write_text(
        json.dumps({"step": step, "manifest_crc32": zlib.crc32(written)})
    )


@pytest.mark.parametrize("crcs", [[], "none", None], ids=["too few", "text", "null"])
def test_a_manifest_whose_checksums_do_not_fit_its_tensors_is_corrupt(
    shm: Path, tmp_path: Path, crcs: object
) -> None:
    """Read as corrupt (the loader falls back to the previous copy), never a crash."""
    ckpt = tmp_path / "ckpt"
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt, policy=api.BusyPolicy.RAISE))
    saver.save(1, {"w": torch.full((N,), 1.0)})
    _rewrite_checksums(store.persist(shm, ckpt, 1), crcs)
    with pytest.raises(store.CorruptCheckpointError):
        store.read_committed(ckpt, 1)
