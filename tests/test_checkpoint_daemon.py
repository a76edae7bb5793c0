"""The saver daemon as a real process: restarts, mid-write kills, resume from shared memory."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from aegis.checkpoint import api, process
from tests.waits import async_wait_until

PY = sys.executable

# A "training process" restarted in place: it records every file it opens under the checkpoint
# directory (audit hook), loads the newest checkpoint and prints what it got.
RESUME = """
import json, os, sys
ckpt = os.environ["AEGIS_CKPT_DIR"]
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(ckpt):
        opened.append(args[0])
sys.addaudithook(hook)
import aegis.checkpoint
step, state = aegis.checkpoint.load_latest()
print(json.dumps({"step": step, "w": float(state["w"].sum()), "opened": opened}))
"""


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"aegis-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemons() -> AsyncIterator[list[process.DaemonProcess]]:
    """Daemons a test starts, killed at its end whatever happened (a failed assertion too)."""
    made: list[process.DaemonProcess] = []
    yield made
    for daemon in made:
        await daemon.stop()


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def killed_and_respawned(daemon: process.DaemonProcess) -> int:
    """SIGKILL the supervised daemon once it runs; return once another runs: the killed pid."""
    await async_wait_until(lambda: daemon.alive)
    first = daemon.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    await async_wait_until(lambda: daemon.alive and daemon.pid != first, what="respawned")
    return first


@pytest.mark.timing
async def test_supervise_restarts_killed_daemon_at_once_and_reports_commits(
    shm: Path, tmp_path: Path
) -> None:
    """DESIGN: restart within 3 s. The only wait between the death (the reaper's wake-up) and
    the new spawn is ``restart_delay_s``; how long a loaded machine takes to spawn is a
    benchmark's business, not a wall-clock bound here."""
    seen: list[int] = []

    async def on_commit(step: int) -> None:
        seen.append(step)

    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=tmp_path / "ckpt")
    daemon = process.DaemonProcess(settings, on_commit=on_commit)
    task = asyncio.create_task(daemon.supervise())
    try:
        await killed_and_respawned(daemon)
        assert daemon.restarts == 1 and settings.restart_delay_s < 3.0
        api.Saver(api.SaverSettings(shm_dir=shm)).save(4, {"w": torch.ones(10)})
        await async_wait_until(lambda: seen == [4])
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert not alive(daemon.pid)


async def test_a_daemon_that_dies_is_warned_about_and_one_stopped_at_the_end_is_not(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every pod's log ended with "saver daemon N exited (raw status 9)", a warning, at every
    job's normal end: the agent's own stop. Only an end nobody asked for is news."""
    caplog.set_level(logging.INFO, logger="aegis.checkpoint.process")
    daemon = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=tmp_path / "c"))
    task = asyncio.create_task(daemon.supervise())
    try:
        first = await killed_and_respawned(daemon)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    second = daemon.pid
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [f"checkpoint saver daemon {first} exited (raw status 9)"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert f"checkpoint saver daemon {second} stopped" in said
    assert not alive(second)


async def test_daemon_killed_mid_write_never_leaves_a_loadable_torn_copy(
    shm: Path, tmp_path: Path, daemons: list[process.DaemonProcess]
) -> None:
    ckpt = tmp_path / "ckpt"
    settings = process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt, max_write_mb_s=20.0)
    daemon = process.DaemonProcess(settings)
    daemons.append(daemon)
    await daemon.start()
    saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
    saver.save(1, {"w": torch.full((1024,), 1.0)})
    await async_wait_until(lambda: saver.committed_steps() == [1])
    saver.save(2, {"w": torch.full((16 * 262144,), 2.0)})  # 16 MB at 20 MB/s: ~0.8 s of writing

    def partly_written() -> bool:
        return any(
            (p / "data.bin").exists() and (p / "data.bin").stat().st_size > 0
            for p in ckpt.glob(".tmp-step-2-*")
        )

    await async_wait_until(partly_written)
    await daemon.stop()  # SIGKILL in the middle of data.bin
    assert not (ckpt / "step-2" / "COMMIT").exists()
    from_disk = api.Saver(api.SaverSettings(shm_dir=tmp_path / "no-shm", ckpt_dir=ckpt))
    loaded = from_disk.load_latest()
    assert loaded is not None and loaded[0] == 1
    assert api.Saver(saver.settings).load_latest() is not None  # shm: still step 1
    await daemon.restart()  # the pending slot is persisted again from the start
    # 1: whole in the other buffer
    await async_wait_until(lambda: saver.committed_steps() == [1, 2])
    assert not list(ckpt.glob(".tmp-step-*"))
    loaded = from_disk.load_latest()
    assert loaded is not None and loaded[0] == 2 and float(loaded[1]["w"][-1]) == 2.0
    await daemon.stop()


async def test_restarted_training_process_resumes_from_shm_without_disk_read(
    shm: Path, tmp_path: Path, daemons: list[process.DaemonProcess]
) -> None:
    ckpt = tmp_path / "ckpt"
    daemon = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt))
    daemons.append(daemon)
    await daemon.start()
    env = {**os.environ, "AEGIS_CKPT_SHM": str(shm), "AEGIS_CKPT_DIR": str(ckpt)}
    save = (
        "import torch, aegis.checkpoint as c\n"
        "for s in (1, 2): c.save(s, {'w': torch.full((100,), float(s))})\n"
    )
    subprocess.run([PY, "-c", save], env=env, check=True, timeout=60)  # the first incarnation
    await async_wait_until(
        lambda: api.Saver(api.SaverSettings(shm_dir=shm)).committed_steps() == [1, 2]
    )
    await daemon.stop()
    out = subprocess.run([PY, "-c", RESUME], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result == {"step": 2, "w": 200.0, "opened": []}
    # A new node (empty shared memory) reads the same step from disk.
    env["AEGIS_CKPT_SHM"] = str(tmp_path / "fresh-shm")
    out = subprocess.run([PY, "-c", RESUME], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["step"] == 2 and result["w"] == 200.0
    assert any(path.endswith("data.bin") for path in result["opened"])


def test_each_submission_gets_its_own_shared_memory_and_an_old_ones_is_removed(
    tmp_path: Path,
) -> None:
    """A new job of the same name on the same node never loads what a killed agent of an
    earlier submission left in shared memory (its directory is removed); other pods' stay, and
    so does that of a run alongside whose agent lives (it was removed under its training)."""
    from aegis.agent import link_settings, linked
    from aegis.spawn import owners

    def settings(token: str, pod: str = "j-0") -> link_settings.LinkSettings:
        return link_settings.LinkSettings(
            grpc_target="127.0.0.1:1", namespace="ns", job="j", pod=pod, token=token,
            node="node-0", ckpt_dir=tmp_path / "ckpt",
        )  # fmt: skip

    first = linked._saver_settings(settings("token-1"), shm_root=tmp_path)
    other_pod = linked._saver_settings(settings("token-1", pod="j-1"), shm_root=tmp_path)
    assert first is not None and other_pod is not None
    assert first.shm_dir != other_pod.shm_dir and first.ckpt_dir == tmp_path / "ckpt" / "j-0"
    for made in (first, other_pod):
        assert made.shm_dir.is_dir()  # made, and claimed by its agent (this process)
        (made.shm_dir / "slot-0").write_bytes(b"state")
    again = linked._saver_settings(settings("token-1"), shm_root=tmp_path)
    assert again is not None and again.shm_dir == first.shm_dir and first.shm_dir.exists()
    # Another run on this host with the same names, its agent alive: its memory stays (the
    # other run's training lost it, and its agent's saver failed).
    concurrent = linked._saver_settings(settings("token-2"), shm_root=tmp_path)
    assert concurrent is not None and concurrent.shm_dir != first.shm_dir
    assert (first.shm_dir / "slot-0").exists()
    killed = owners.process_name().rsplit("=", 1)[0] + "=1\n"  # a pid of another start time: gone
    for dead in (first, concurrent):
        (dead.shm_dir / owners.OWNER).write_text(killed)
    second = linked._saver_settings(settings("token-3"), shm_root=tmp_path)
    assert second is not None and second.shm_dir != first.shm_dir
    assert not first.shm_dir.exists()  # the earlier submission's memory is gone
    assert not concurrent.shm_dir.exists()
    assert (other_pod.shm_dir / "slot-0").exists()  # another pod's is not touched


def test_an_agent_that_cannot_claim_its_shared_memory_still_starts(tmp_path: Path) -> None:
    """Naming the agent the owner of its memory writes a file there: where that fails (a full
    /dev/shm, here no directory can be made) the agent starts all the same, as it did before
    owners were named (its saves then say what is wrong)."""
    from aegis.agent import link_settings, linked

    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    s = link_settings.LinkSettings(
        grpc_target="127.0.0.1:1", namespace="ns", job="j", pod="j-0", token="t",
        node="node-0", ckpt_dir=tmp_path,
    )  # fmt: skip
    made = linked._saver_settings(s, shm_root=not_a_dir)
    assert made is not None and made.shm_dir.parent == not_a_dir


def _local(shm: Path, ckpt: Path, rank: int) -> api.SaverSettings:
    """A rank's saver settings in a pod whose command runs two ranks (torchrun's environment)."""
    env = {"AEGIS_CKPT_SHM": str(shm), "AEGIS_CKPT_DIR": str(ckpt),
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
    return api.SaverSettings.from_env(env)


async def test_a_step_is_the_pods_commit_only_once_every_local_rank_committed_it(
    shm: Path, tmp_path: Path, daemons: list[process.DaemonProcess]
) -> None:
    """Two local ranks save into their own slots; the daemon persists each into its own
    directory, and reports the step for the pod (what the agent tails) after the second."""
    ckpt = tmp_path / "ckpt"
    daemon = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt))
    daemons.append(daemon)
    await daemon.start()
    first, second = (api.Saver(_local(shm, ckpt, rank)) for rank in (0, 1))
    assert first.settings.shm_dir == shm / "local-0"
    assert second.settings.ckpt_dir == ckpt / "local-1"
    first.save(2, {"w": torch.full((256,), 2.0)})
    await async_wait_until(lambda: first.committed_steps() == [2])
    assert await daemon.poll_commits() == []  # rank 1 has not saved step 2 yet
    second.save(2, {"w": torch.full((256,), 1002.0)})
    assert await async_wait_until(daemon.poll_commits, what="the pod's commit") == [2]
    loaded = [api.Saver(_local(tmp_path / "no-shm", ckpt, rank)).load_latest() for rank in (0, 1)]
    got = [(step, float(state["w"][0])) for step, state in filter(None, loaded)]
    assert got == [(2, 2.0), (2, 1002.0)]  # from disk: each rank's own copy
    await daemon.stop()


def test_a_pod_where_one_local_rank_never_saves_commits_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``if local_rank == 0: save(...)`` under torchrun: the pod's commit would name a step
    rank 1 cannot resume from, so none is made, and the daemon's log says why (once)."""
    from aegis.checkpoint import daemon
    from aegis.checkpoint import layout as lay

    pod, shared = tmp_path / "shm", daemon.Shared(daemon.resumed_state(tmp_path / "shm"))
    rank0 = lay.local_dir(pod, 0)
    rank0.mkdir(parents=True)
    (pod / lay.LOCAL_WORLD).write_text("2")
    where = daemon.Where(pod, rank0, tmp_path / "ckpt" / "local-0")
    for step in (2, 4):
        lay.slot_json(rank0, step).write_text("{}")
        lay.committed_marker(rank0, step).write_bytes(b"")
        daemon.announce(where, step, where.ckpt / f"step-{step}", shared)
    assert not (pod / lay.COMMITS_LOG).exists()
    said = [r.getMessage() for r in caplog.records if "ever saved" in r.getMessage()]
    assert said == ["local-0 committed its second save, but only 1 of the pod's 2 local ranks "
                    "ever saved: no step is the pod's commit until every local rank saves it "
                    "(every rank calls aegis.checkpoint.save)"]  # fmt: skip
