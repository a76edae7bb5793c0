"""``aegis ctl drain`` against a running ``aegis run`` job (real nats-server, agents, gloo DDP):
the job checkpoints on request, the pod moves to a spare at the commit, the job resumes from
that step with nothing counted; without the API, when its next periodic checkpoint would come
after the drain's deadline, it drains at once from the last one;
the deadline evicts anyway; undrain, an empty node and bad names behave; a standalone master
replica serves the same controls to its leader's jobs."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from aegis.cli import run_cmd
from aegis.core.phases import Phase
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform
from aegis.platforms.replicated_run import ReplicatedRun
from tests.jsonl import json_lines
from tests.waits import async_wait_until

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(300)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"
HANG = Path(__file__).parent / "bin" / "hang.py"
AEGIS = [sys.executable, "-m", "aegis.cli.main"]
STEP = re.compile(r"rank=(\d+) step (\d+) ")
RESUMED = re.compile(r"rank=(\d+) resumed from aegis checkpoint at step (\d+)")

Scenario = Callable[[JobRunner, LocalPlatform, tuple[str, str]], Awaitable[None]]


async def ctl(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "ctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def run_with(settings: local_run.RunSettings, scenario: Scenario) -> local_run.RunResult:
    """Run the job; once it trains and its control channel is up, play ``scenario``."""
    observers = run_cmd.RunObservers(None)
    seen: dict[str, Any] = {}

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        observers.attach(runner, platform)
        seen["runner"], seen["platform"] = runner, platform

    job = asyncio.create_task(local_run.run_local(settings, observe=observe))
    try:
        await async_wait_until(lambda: "runner" in seen or job.done(), 60, "the job to start")
        runner = seen["runner"]
        await async_wait_until(lambda: bool(runner.safe.steps) or job.done(), 120, "training")
        assert observers.control_ready is not None
        await asyncio.wait_for(observers.control_ready.wait(), 30)
        await scenario(runner, seen["platform"], ("--log-dir", str(settings.log_dir)))
        return await asyncio.wait_for(job, 200)
    finally:
        observers.close()
        if not job.done():
            job.cancel()


def first(rows: list[dict[str, Any]], kind: str, after: int = -1, **match: Any) -> int:
    return next(
        i
        for i, r in enumerate(rows)
        if i > after and r["type"] == kind and all(r.get(k) == v for k, v in match.items())
    )


def steps_by_rank(pod_log: Path) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Every training step each rank logged (in order), and the step each one resumed from."""
    done: dict[int, list[int]] = {}
    resumed: dict[int, int] = {}
    for line in pod_log.read_text(errors="replace").splitlines():
        if m := STEP.search(line):
            done.setdefault(int(m[1]), []).append(int(m[2]))
        elif m := RESUMED.search(line):
            resumed[int(m[1])] = int(m[2])
    return done, resumed


def train(tmp_path: Path, *extra: str) -> tuple[str, ...]:
    return (sys.executable, str(TRAIN), "--steps", "150", "--step-time-s", "0.05",
            "--ckpt-dir", str(tmp_path / "ckpt"), *extra)  # fmt: skip


async def test_drain_checkpoints_on_request_moves_the_pod_and_resumes_at_that_step(
    tmp_path: Path,
) -> None:
    settings = local_run.RunSettings(
        # no periodic checkpoint at all; the ranks wait at step 20 until the request has come
        # (however long `aegis ctl` takes to start), so it lands before the job ends
        command=train(tmp_path, "--ckpt-every", "100000", "--hold-at-step", "20"),
        nodes=3, spare_nodes=2, max_retry=2, job="drain", log_dir=tmp_path / "logs",
        grace_s=3.0, ckpt_dir=tmp_path / "ckpt", hang_timeout_s=600.0,
    )  # fmt: skip
    replies: list[tuple[int, str]] = []

    async def scenario(runner: JobRunner, platform: LocalPlatform, where: tuple[str, str]) -> None:
        await async_wait_until(
            lambda: runner.safe.target_step(time.monotonic()) > 10, 60, "a few steps"
        )
        replies.append(await ctl("drain", "node-1", "--reason", "kernel upgrade", *where))
        await async_wait_until(lambda: "node-1" in platform.blacklist, what="the blacklist")

    result = await run_with(settings, scenario)
    code, out = replies[0]
    assert code == 0 and "drained node-1: job drain: drain-1 leave(s) at the next checkpoint" in out
    status = result.status
    assert status.phase is Phase.SUCCEED
    assert status.recover_count == 0 and {i.retries for i in status.pod_infos.values()} == {0}
    assert status.error_nodes == ()  # drained, not broken
    assert status.pod_infos["drain-1"].node == "spare-0"  # type: ignore[index]
    rows = json_lines(result.log_dir / "events.jsonl")
    drained = first(rows, "DrainRequested", pods=["drain-1"], reason="kernel upgrade")
    commit = first(rows, "CheckpointCommitted", after=drained)
    moved = first(rows, "PodRestarted", after=commit, pod="drain-1", node="spare-0")
    assert not any(r["type"] == "DrainForced" for r in rows)
    assert drained < commit < moved
    k = rows[commit]["step"]
    for rank in range(3):
        done, resumed = steps_by_rank(result.log_dir / "pods" / f"drain-{rank}.log")
        assert resumed == {rank: k}, (rank, resumed)
        before = done[rank][: done[rank].index(k) + 1]
        assert before == list(range(1, k + 1))  # the first incarnation stopped right at k
        assert done[rank][len(before) :] == list(range(k + 1, 151))  # zero steps redone


async def test_a_script_without_the_api_drains_from_its_last_periodic_checkpoint(
    tmp_path: Path,
) -> None:
    # held at step 60 until the request has come, and at the end until the test is done; 0.2 s
    # a step: the next periodic save (step 100, due 1.5 intervals of 50 steps after step 50's)
    # comes after the drain's deadline of 10 s, so the drain does not wait for it
    command = (sys.executable, str(TRAIN), "--steps", "150", "--step-time-s", "0.2",
               "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "50", "--no-ckpt-requests",
               "--hold-at-step", "60", "--hold-at-end-until", str(tmp_path / "done"))  # fmt: skip
    settings = local_run.RunSettings(
        command=command,
        nodes=2, spare_nodes=2, max_retry=2, job="plain", log_dir=tmp_path / "logs",
        grace_s=3.0, ckpt_dir=tmp_path / "ckpt",
    )  # fmt: skip
    replies: list[tuple[int, str]] = []

    async def scenario(runner: JobRunner, platform: LocalPlatform, where: tuple[str, str]) -> None:
        await async_wait_until(
            lambda: runner.safe.committed_step >= 50, 60, "a periodic checkpoint"
        )
        replies.append(await ctl("drain", "node-0", "--deadline-s", "10", *where))
        await async_wait_until(lambda: runner.status.drain_count == 0, 60, "the eviction")
        replies.append(await ctl("drain", "spare-1", *where))  # nothing runs there
        replies.append(await ctl("drain", "node-7", *where))  # no such node
        replies.append(await ctl("drain", "bad/name", *where))
        replies.append(await ctl("undrain", "node-0", *where))
        assert "node-0" not in platform.blacklist and "spare-1" in platform.blacklist
        (tmp_path / "done").touch()

    result = await run_with(settings, scenario)
    assert replies[0][0] == 0, replies[0]
    assert replies[1] == (0, "aegis ctl: drained spare-1: no pod runs there, nothing to move\n")
    code, out = replies[2]
    assert code == 1 and out.startswith("aegis ctl: unknown node 'node-7' (known: node-0,")
    assert len(out.splitlines()) == 1
    code, out = replies[3]
    assert code == 2 and out.count("\n") == 1 and "bad node name 'bad/name'" in out
    assert replies[4] == (0, "aegis ctl: undrained node-0: schedulable again\n")
    status = result.status
    assert status.phase is Phase.SUCCEED and status.recover_count == 0
    assert status.pod_infos["plain-0"].node == "spare-0"  # type: ignore[index]
    rows = json_lines(result.log_dir / "events.jsonl")
    forced = rows[first(rows, "DrainForced", pods=["plain-0"])]
    assert "does not take checkpoint requests" in forced["reason"]
    assert "resuming from the last periodic checkpoint (step " in forced["reason"]
    _, resumed = steps_by_rank(result.log_dir / "pods" / "plain-0.log")
    assert resumed[0] % 50 == 0  # a periodic one


async def test_the_drain_deadline_evicts_anyway_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = local_run.RunSettings(
        command=(sys.executable, str(HANG), "progress"),  # steps, never saves, never ends
        nodes=2, spare_nodes=1, max_retry=1, job="late", log_dir=tmp_path / "logs", grace_s=2.0,
        hang_timeout_s=600.0,
    )  # fmt: skip

    async def scenario(runner: JobRunner, platform: LocalPlatform, where: tuple[str, str]) -> None:
        code, out = await ctl("drain", "node-1", "--deadline-s", "0", *where)
        assert code == 0, out
        await async_wait_until(
            lambda: (
                runner.status.pod_infos["late-1"].node == "spare-0"  # type: ignore[index]
                and runner.status.phase is Phase.RUN_COMMAND
            ),
            90,
            "the move",
        )
        code, out = await ctl("stop", "late", *where)
        assert code == 0, out

    result = await run_with(settings, scenario)
    assert result.status.phase is Phase.FAILED and result.status.recover_count == 0
    rows = json_lines(result.log_dir / "events.jsonl")
    forced = rows[first(rows, "DrainForced", pods=["late-1"])]
    assert forced["reason"] == "no checkpoint committed within the drain deadline of 0 s"
    assert any("evicting anyway" in r.getMessage() for r in caplog.records)


async def test_a_standalone_master_replica_drains_through_its_control_file(
    tmp_path: Path,
) -> None:
    settings = local_run.RunSettings(
        command=train(tmp_path, "--ckpt-every", "100000", "--hold-at-step", "20",
                      "--hold-at-end-until", str(tmp_path / "done")),
        nodes=3, spare_nodes=1, max_retry=2, job="ha", log_dir=tmp_path,
        heartbeat_timeout_s=4.0, grace_s=3.0, hang_timeout_s=600.0,
    )  # fmt: skip
    run = ReplicatedRun(settings, 2, tmp_path)  # two `aegis master` processes
    await run.start()
    try:

        async def trains() -> bool:
            ready = (tmp_path / "control.json").exists() and await run.leader() is not None
            return ready and (await run.status()).phase is Phase.RUN_COMMAND

        await async_wait_until(trains, 120, "training under a leader with a control file")
        code, out = await ctl("drain", "node-2", "--reason", "psu swap", "--log-dir", str(tmp_path))
        assert code == 0 and "drained node-2: job ha: ha-2 leave(s)" in out, out
        await async_wait_until(lambda: "node-2" in run.platform.blacklist, 30, "the platform")
        assert run.platform.blacklist["node-2"] == "drained: psu swap"
        code, out = await ctl("undrain", "node-2", "--log-dir", str(tmp_path))
        assert code == 0, out
        await async_wait_until(lambda: "node-2" not in run.platform.blacklist, 30, "undrain")
        (tmp_path / "done").touch()
        result = await run.wait()
    finally:
        for proc in run.masters:
            if proc.poll() is None:
                proc.kill()
        if not run.bus.client.is_closed:  # failed before the end: nothing left behind
            await run.finish()
    assert result.status.phase is Phase.SUCCEED and result.status.recover_count == 0
    assert result.status.error_nodes == ()
    assert result.status.pod_infos["ha-2"].node == "spare-0"  # type: ignore[index]
