"""A real ``aegis run`` job whose checkpoint directory sits on a small tmpfs that fills up:
training keeps stepping, the master's fault log and ``aegis_checkpoint_persist_failures_total``
say why (once per outage, every attempt counted), persisting resumes once space is freed, the
job succeeds and every committed step loads."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aegis.checkpoint import layout as lay
from aegis.checkpoint import store
from aegis.cli import run_cmd
from aegis.core.phases import Phase
from aegis.master import metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform
from aegis.tools import incidents as incidents_tool
from aegis.tools import joblog
from aegis.wire import messages as m
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = Path(__file__).parent / "bin" / "disk_full_train.py"
PODS = ("full-0", "full-1")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                          check=False, capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    filler = where / "filler"
    with filler.open("wb", buffering=0) as out, pytest.raises(OSError):
        while True:
            out.write(b"\0" * 4096)
    return filler


def last_step(control: Path, rank: int) -> int:
    path = control / f"rank-{rank}.steps"
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-1]) if lines else 0


def failures(scrape: str) -> float:
    for line in scrape.splitlines():
        if line.startswith('aegis_checkpoint_persist_failures_total{errno="ENOSPC"}'):
            return float(line.split()[-1])
    return 0.0


async def test_a_full_checkpoint_disk_is_reported_training_goes_on_and_persisting_resumes(
    tmp_path: Path, disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aegis.master")
    control = tmp_path / "control"
    control.mkdir()
    settings = local_run.RunSettings(
        command=(sys.executable, str(TRAIN), str(control)), nodes=2, spare_nodes=0,
        max_retry=1, job="full", log_dir=tmp_path / "logs", grace_s=3.0, ckpt_dir=disk,
        hang_timeout_s=0,
    )  # fmt: skip
    hub = metrics.MasterMetrics()
    observers = run_cmd.RunObservers(None, metrics_hub=hub, serve_control=False)
    seen: dict[str, Any] = {}
    reports: list[tuple[str, m.CheckpointStoreData]] = []

    def on_message(runner: JobRunner, msg: m.Message) -> None:
        if isinstance(msg.data, m.CheckpointStoreData):
            reports.append((msg.pod, msg.data))

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        observers.attach(runner, platform)
        runner.message_listeners.append(on_message)
        seen["runner"] = runner

    def committed() -> int:
        return int(seen["runner"].notes.committed_step)

    job = asyncio.create_task(local_run.run_local(settings, observe=observe))
    try:
        await async_wait_until(lambda: "runner" in seen or job.done(), 60, "the job to start")
        await async_wait_until(lambda: committed() >= 5 or job.done(), 90, "a first commit")
        filler = fill(disk)
        filled_at = [last_step(control, r) for r in range(2)]
        await async_wait_until(
            lambda: {pod for pod, r in reports if r.opened} == set(PODS) or job.done(),
            60,
            "both pods to report the full store",
        )
        stalled_commit = committed()
        await async_wait_until(  # saves every 5 steps go on from memory: no stall
            lambda: all(last_step(control, r) >= filled_at[r] + 40 for r in range(2))
            or job.done(), 90, "training to go on past the full disk",
        )  # fmt: skip
        assert not job.done()
        await async_wait_until(lambda: failures(hub.scrape()) >= 4, 60, "failed attempts counted")
        opened = [r for _, r in reports if r.opened]
        assert len(opened) == 2  # one per pod's outage, though it fails many times
        for pod, report in ((p, r) for p, r in reports if r.opened):
            assert report.errno == 28 and report.strerror == "No space left on device"
            assert report.directory == str(disk / pod)
        assert committed() == stalled_commit  # nothing is committed while the disk is full
        filler.unlink()
        await async_wait_until(
            lambda: {pod for pod, r in reports if r.ok} == set(PODS) or job.done(),
            60,
            "persisting to resume",
        )
        await async_wait_until(lambda: committed() > stalled_commit, 60, "new commits")
        (control / "finish").write_text("")
        result = await asyncio.wait_for(job, 120)
    finally:
        observers.close()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
    _assert_told_once_and_every_commit_loads(result, disk, caplog, stalled_commit)


def _assert_told_once_and_every_commit_loads(
    result: local_run.RunResult, disk: Path, caplog: pytest.LogCaptureFixture, stalled_commit: int
) -> None:
    """The job succeeded with no recovery; the fault log and the master's log say down and
    back once per pod; every committed step of each pod loads."""
    assert result.status.phase is Phase.SUCCEED
    assert result.status.recover_count == 0
    faults = (result.log_dir / "faults.jsonl").read_text()
    for pod in PODS:
        assert (f"checkpoint store down: [Errno 28] No space left on device: {disk / pod}"
                in faults)  # fmt: skip
    assert faults.count("checkpoint store down") == 2
    master_lines = [r.getMessage() for r in caplog.records if r.name.startswith("aegis.master.")]
    down = [line for line in master_lines if "checkpoint store" in line and " down: " in line]
    assert len(down) == 2 and all("[Errno 28] No space left on device" in line for line in down)
    assert sum("checkpoint store" in line and " back after " in line for line in master_lines) == 2
    assert faults.count("checkpoint store back") == 2
    outages = incidents_tool.store_outages(
        (result.log_dir / joblog.EVENTS).read_text().splitlines()
    )  # what ``aegis incidents`` lists: one per pod, down for ENOSPC, back
    assert sorted(o.pod for o in outages) == sorted(PODS)
    assert all(o.errno == 28 and o.down_s is not None and o.failures >= 1 for o in outages)
    assert joblog.load(result.log_dir).status.phase is Phase.SUCCEED  # the reports replay fine
    for pod in PODS:  # every committed step loads, with its own values
        ckpt = disk / pod
        steps = [s for s in lay.disk_steps(ckpt) if (lay.step_dir(ckpt, s) / lay.COMMIT).exists()]
        assert steps and max(steps) > stalled_commit
        for step in steps:
            copy = store.read_committed(ckpt, step)
            assert copy.layout.step == step and len(copy.data) == 16384 * 4
