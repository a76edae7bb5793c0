"""At the job's end the agent persists the training's last save before it stops the saver.

A save returns once it is in shared memory; the saver daemon writes it to the checkpoint
directory afterwards. On the master's exit order the agent waits for that (at most ``flush_s``)
before it kills the daemon and removes the memory that holds the only copy. On a SIGTERM it
does not wait (the platform's grace period is short, and a torn-down cluster must be gone at
once), and a SIGTERM during the wait ends it. A real daemon process and the real saver here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from aegis.agent import linked
from aegis.checkpoint import api, outage, process
from aegis.spawn import spawner as spawning
from tests.waits import async_wait_until

pytestmark = pytest.mark.timeout(240)

MB16 = 16 * 262144  # float32 elements: 16 MiB


class _Link:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def close(self) -> None:
        self.calls.append("link closed")


class _Sup:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def stop(self) -> None:
        self.calls.append("training stopped")


@pytest.fixture
async def shm(tmp_path: Path) -> AsyncIterator[Path]:
    path = Path("/dev/shm") / f"aegis-test-flush-{tmp_path.name}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _saver_with_a_save(
    shm: Path, ckpt: Path, mb_s: float, flush_s: float = 120.0
) -> linked.Saver:
    """A supervised daemon writing at ``mb_s``, and a 16-MiB save of step 7 handed to it."""
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt, max_write_mb_s=mb_s,
                                      flush_s=flush_s)  # fmt: skip
    daemon = process.DaemonProcess(settings)
    supervising = asyncio.create_task(daemon.supervise())
    await async_wait_until(lambda: daemon.alive, 60, "the saver daemon")
    state = {"w": torch.full((MB16,), 7.0)}
    api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt)).save(7, state)
    return daemon, supervising


def _on_disk(ckpt: Path, tmp_path: Path) -> int | None:
    loaded = api.Saver(api.SaverSettings(shm_dir=tmp_path / "no-shm", ckpt_dir=ckpt)).load_latest()
    if loaded is None:
        return None
    assert float(loaded[1]["w"][-1]) == 7.0
    return loaded[0]


class _FailingLink(_Link):
    async def close(self) -> None:
        await super().close()
        raise ConnectionError("nats: unexpected EOF")


@pytest.mark.parametrize("link", [_Link, _FailingLink], ids=["link-closes", "link-close-fails"])
async def test_on_the_exit_order_the_last_save_is_persisted_before_the_saver_stops(
    tmp_path: Path, shm: Path, link: type[_Link]
) -> None:
    """16 MiB at 20 MB/s: about 0.8 s of writing after the save returned. The shut-down waits
    for it, then stops the daemon and removes the memory: the step is on disk, whole. Without
    the wait the daemon was killed mid-write and the only copy removed.

    Also when the master is gone and closing its connection raises: the training is stopped,
    the save persisted, the saver stopped (while the agent's reaper still collects it) and its
    memory removed all the same. Before, the saver was left running into the event loop's
    teardown, where nothing collected it any more, and the agent never ended (found by the
    emulated cluster's SIGKILLed-run test)."""
    calls: list[str] = []
    ckpt = tmp_path / "ckpt"
    daemon, supervising = await _saver_with_a_save(shm, ckpt, mb_s=20.0)
    await linked._shut_down(link(calls), [], _Sup(calls), (daemon, supervising),  # type: ignore[arg-type]
                            asyncio.Event())  # fmt: skip
    assert calls == ["link closed", "training stopped"]
    assert not daemon.alive and supervising.done() and not shm.exists()
    assert _on_disk(ckpt, tmp_path) == 7


async def test_after_a_sigterm_the_shut_down_does_not_wait_for_the_saver(
    tmp_path: Path, shm: Path
) -> None:
    """The agent was SIGTERMed (its pod deleted, its cluster torn down): the saver is stopped
    at once, with a 16-s write under way and an hour of ``flush_s``; nothing half-written is
    ever loaded."""
    calls: list[str] = []
    ckpt = tmp_path / "ckpt"
    daemon, supervising = await _saver_with_a_save(shm, ckpt, mb_s=1.0, flush_s=3600.0)
    terminated = asyncio.Event()
    terminated.set()
    await linked._shut_down(_Link(calls), [], _Sup(calls), (daemon, supervising),  # type: ignore[arg-type]
                            terminated)  # fmt: skip
    assert not daemon.alive and not shm.exists()
    assert _on_disk(ckpt, tmp_path) is None


async def test_a_sigterm_during_the_wait_ends_it(tmp_path: Path, shm: Path) -> None:
    calls: list[str] = []
    ckpt = tmp_path / "ckpt"
    daemon, supervising = await _saver_with_a_save(shm, ckpt, mb_s=1.0, flush_s=3600.0)
    terminated = asyncio.Event()
    shut_down = asyncio.create_task(
        linked._shut_down(_Link(calls), [], _Sup(calls), (daemon, supervising), terminated)  # type: ignore[arg-type]
    )
    await async_wait_until(lambda: "training stopped" in calls, 60, "the training stopped")
    assert not shut_down.done()  # waiting on the saver (16 s of writing)
    terminated.set()
    await shut_down
    assert not daemon.alive and not shm.exists()
    assert _on_disk(ckpt, tmp_path) is None


async def test_the_flush_does_not_wait_on_a_store_that_is_down_or_on_no_daemon(
    tmp_path: Path, shm: Path
) -> None:
    """While the durable directory fails (``store-down``), or with no daemon to persist, the
    unpersisted step is named at once (the hour of ``flush_s`` would end the test by its
    timeout)."""
    ckpt = tmp_path / "not-a-directory"
    ckpt.write_text("")
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt, flush_s=3600.0)
    shm.mkdir()
    api.Saver(api.SaverSettings(shm_dir=shm)).save(3, {"w": torch.ones(4)})
    assert await process.DaemonProcess(settings).flush() == [3]  # no daemon at all
    daemon = process.DaemonProcess(settings)
    supervising = asyncio.create_task(daemon.supervise())
    try:
        await async_wait_until((shm / outage.STORE_DOWN).exists, 60, "store down")
        assert await daemon.flush() == [3]
    finally:
        supervising.cancel()
        await asyncio.gather(supervising, return_exceptions=True)


def test_when_the_flush_gives_up() -> None:
    def why(**kw: bool) -> str | None:
        flags = {"store_down": False, "saver_running": True, "interrupted": False,
                 "timed_out": False} | kw  # fmt: skip
        return process.flush_given_up(**flags)

    assert why() is None
    assert why(interrupted=True) == "the agent was stopped (SIGTERM)"
    assert why(store_down=True) == "the checkpoint store is down"
    assert why(saver_running=False) == "no saver daemon runs"
    assert why(timed_out=True) == "timed out"


async def test_stopping_a_daemon_nothing_collects_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawner that never reports the killed daemon's end (its reaper closed) does not hold
    ``stop`` for ever: it gives up after ``STOP_WAIT_S``."""

    class _Deaf(spawning.LocalSpawner):
        async def wait(self, pid: int) -> int:
            await asyncio.Event().wait()  # never
            return 0

    monkeypatch.setattr(process, "STOP_WAIT_S", 0.5)
    settings = process.DaemonSettings(shm_dir=tmp_path / "shm", ckpt_dir=tmp_path / "ckpt")
    daemon = process.DaemonProcess(settings, spawner=_Deaf())
    await daemon.start()
    pid = daemon.pid
    assert pid is not None
    try:
        await daemon.stop()
    finally:
        with contextlib.suppress(ChildProcessError):  # the spawner's part, done here
            os.waitpid(pid, 0)


async def test_the_shut_down_cleans_up_after_a_task_that_crashed(tmp_path: Path) -> None:
    """A crashed link task (logged and raised by the agent) does not cut the clean-up short:
    the link is closed, the training stopped, the saver stopped and its memory removed all the
    same."""
    calls: list[str] = []

    async def crash() -> None:
        raise RuntimeError("a link task crashed")

    crashed = asyncio.create_task(crash())
    await asyncio.wait({crashed})
    shm = tmp_path / "shm"
    daemon = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=tmp_path / "c"))
    supervising = asyncio.create_task(daemon.supervise())
    await async_wait_until(lambda: daemon.alive, 60, "the saver daemon")
    saver = daemon, supervising
    await linked._shut_down(_Link(calls), [crashed], _Sup(calls), saver, asyncio.Event())  # type: ignore[arg-type]
    assert calls == ["link closed", "training stopped"]
    assert not shm.exists() and not daemon.alive and supervising.done()
