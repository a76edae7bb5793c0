"""The master survives its own failure: real nats-server, two real master processes, real
agents and a real 3-rank gloo job. The leader is SIGKILLed (or stopped past its lease) at
chosen points; the job must finish with exactly the counts one master would have produced."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun
from tests.waits import async_wait_until

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(180)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


def _settings(tmp_path: Path, *extra: str) -> RunSettings:
    command = (
        sys.executable,
        str(TRAIN),
        "--steps",
        "60",
        "--ckpt-every",
        "5",
        "--ckpt-dir",
        str(tmp_path / "ckpt"),
        "--step-time-s",
        "0.05",
        *extra,
    )
    return RunSettings(
        command=command,
        nodes=3,
        spare_nodes=1,
        max_retry=2,
        job="ha",
        heartbeat_timeout_s=4.0,
        grace_s=3.0,
        log_dir=tmp_path,
    )


@pytest.fixture
async def make_run(tmp_path: Path) -> AsyncIterator[Callable[..., ReplicatedRun]]:
    runs: list[ReplicatedRun] = []

    def make(*extra: str, master_env: dict[str, str] | None = None) -> ReplicatedRun:
        run = ReplicatedRun(_settings(tmp_path, *extra), 2, tmp_path, master_env=master_env)
        runs.append(run)
        return run

    yield make
    for run in runs:  # a failed test must not leave masters or agents behind
        for proc in run.masters:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _leader_when(run: ReplicatedRun, phase: Phase) -> int:
    state: dict[str, object] = {}

    async def reached() -> bool:
        state["phase"] = (await run.status()).phase
        state["leader"] = await run.leader()
        return state["phase"] is phase and state["leader"] is not None

    await async_wait_until(reached, timeout_s=90, what=f"phase {phase} with a leader")
    leader = state["leader"]
    assert isinstance(leader, int)
    return leader


def _incarnations(log_dir: Path) -> list[int]:
    return [
        sum(1 for line in p.read_text().splitlines() if "fresh start" in line or "resumed" in line)
        for p in sorted((log_dir / "pods").glob("*.log"))
    ]


async def test_leader_killed_in_run_command_training_never_restarts(
    make_run: Callable[..., ReplicatedRun], tmp_path: Path
) -> None:
    run = make_run()
    await run.start()
    leader = await _leader_when(run, Phase.RUN_COMMAND)
    agents = run.agent_pids()
    run.masters[leader].send_signal(signal.SIGKILL)
    result = await run.wait()
    assert result.status.phase is Phase.SUCCEED
    assert result.ended == "every pod finished with exit code 0"  # as the new leader stored it
    assert [i.retries for _, i in sorted(result.status.pod_infos.items())] == [0, 0, 0]
    assert run.agent_pids() == agents  # no pod was replaced
    assert _incarnations(tmp_path) == [1, 1, 1]  # and no training process restarted
    new_leader_log = (tmp_path / f"master-{1 - leader}.log").read_text()
    assert "leads job default.ha" in new_leader_log


async def test_leader_killed_in_troubleshooting_counts_the_fault_once(
    make_run: Callable[..., ReplicatedRun], tmp_path: Path
) -> None:
    # an exit with no traceback gets a troubleshooting round (a traceback would not)
    run = make_run("--exit-at-step", "20", "--exit-rank", "1")
    await run.start()
    leader = await _leader_when(run, Phase.TROUBLESHOOTING)
    run.masters[leader].send_signal(signal.SIGKILL)
    result = await run.wait()
    assert result.status.phase is Phase.SUCCEED
    assert result.status.recover_count == 1
    assert [i.retries for _, i in sorted(result.status.pod_infos.items())] == [1, 1, 1]


async def test_leader_dying_between_status_write_and_order_is_covered_by_the_new_leader(
    make_run: Callable[..., ReplicatedRun], tmp_path: Path
) -> None:
    run = make_run(
        "--exit-at-step",
        "20",
        "--exit-rank",
        "0",
        master_env={"AEGIS_CHAOS_EXIT_AFTER_PERSIST": "Troubleshooting"},
    )
    await run.start()
    result = await run.wait()
    assert (tmp_path / ".chaos-done").exists()  # a leader did die after the write
    assert sum(proc.poll() is not None for proc in run.masters) >= 1
    assert result.status.phase is Phase.SUCCEED
    assert result.status.recover_count == 1
    assert [i.retries for _, i in sorted(result.status.pod_infos.items())] == [1, 1, 1]


async def test_deposed_leader_that_wakes_up_cannot_write_or_order(
    make_run: Callable[..., ReplicatedRun], tmp_path: Path
) -> None:
    run = make_run("--steps", "90")
    await run.start()
    old = await _leader_when(run, Phase.RUN_COMMAND)
    os.kill(run.masters[old].pid, signal.SIGSTOP)
    await async_wait_until(
        lambda: _is_leader(run, 1 - old), timeout_s=30, what="the standby takes over"
    )
    os.kill(run.masters[old].pid, signal.SIGCONT)
    result = await run.wait()
    assert result.status.phase is Phase.SUCCEED
    assert [i.retries for _, i in sorted(result.status.pod_infos.items())] == [0, 0, 0]
    old_log = (tmp_path / f"master-{old}.log").read_text()
    assert "lost the lead" in old_log or "deposed" in old_log
    assert _incarnations(tmp_path) == [1, 1, 1]


async def _is_leader(run: ReplicatedRun, index: int) -> bool:
    return await run.leader() == index
