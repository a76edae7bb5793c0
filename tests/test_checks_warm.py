"""The collective checks of a round from one child, forked from the agent's warm check
interpreter (issue 9): real forkservers started through the agent's reaper, real gloo groups."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from aegis.agent import reaper
from aegis.checks import base, env, group, host, suites
from aegis.core.recovery import CheckType
from aegis.spawn.ports import free_port
from tests import forkserver_harness as harness
from tests.waits import async_wait_until

CONNECT, PERF = CheckType.ALLREDUCE_CONNECT, CheckType.ALLREDUCE_PERF
the_reaper = harness.the_reaper  # a fixture


def settings(
    rank: int,
    world: int,
    port: int,
    check_host: host.CheckHost | None,
    scratch: Path,
    budget_s: float = 60.0,
) -> base.CheckSettings:
    return base.CheckSettings(
        scratch_dir=scratch / f"pod-{rank}",
        group=base.GroupInfo(rank, world, "127.0.0.1", port),
        budgets_s={**base.DEFAULT_BUDGETS_S, CONNECT: budget_s, PERF: budget_s},
        perf=base.PerfSettings(compute_s=0.2),
        host=check_host,
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_troubleshoot_takes_both_collectives_from_one_warm_child_when_host_is_ready(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    async with host.CheckHost(the_reaper) as h0, host.CheckHost(the_reaper) as h1:
        assert await h0.ready() and await h1.ready()
        port = free_port()
        rounds = await asyncio.gather(
            suites.troubleshoot(settings(0, 2, port, h0, tmp_path)),
            suites.troubleshoot(settings(1, 2, port, h1, tmp_path)),
        )
        for results in rounds:
            by_type = {r.check_type: r for r in results}
            assert [r.check_type for r in results] == list(suites.TROUBLESHOOT)
            assert all(r.passed and not r.not_applicable for r in (by_type[CONNECT], by_type[PERF]))
            assert by_type[CONNECT].result == "all_reduce and all_gather exact across 2 pod(s)"
            assert "compute" in by_type[PERF].result and "best pair" in by_type[PERF].result
            report = env.parse_report(by_type[CheckType.RUNTIME].result)
            assert by_type[CheckType.RUNTIME].passed and report is not None
            assert report.torch.startswith("2.13")
        for h in (h0, h1):  # one child per pod and round, asked for the three checks
            assert [child.args[0] for child in h.forked] == ["runtime,connect,perf"]
            assert h.made == 1


async def test_collective_round_answers_both_checks_from_one_process_when_forked_warm(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    async with host.CheckHost(the_reaper) as h0, host.CheckHost(the_reaper) as h1:
        port = free_port()
        pods = [
            group.CheckChildRound(settings(rank, 2, port, h, tmp_path), [CONNECT, PERF])
            for rank, h in enumerate((h0, h1))
        ]
        try:
            for check in (CONNECT, PERF):
                outcomes = await asyncio.gather(*(pod.verdict(check) for pod in pods))
                assert all(o.passed for o in outcomes), outcomes
        finally:
            for pod in pods:
                await pod.close()
        for pod, h in zip(pods, (h0, h1), strict=True):
            assert pod.child is not None and pod.child.warm
            assert pod.answers["connect"]["pid"] == pod.answers["perf"]["pid"] == h.forked[0].pid
            assert pod.answers["connect"]["join_s"] == pod.answers["perf"]["join_s"]  # one group
            assert gone(pod.child.pid)


async def test_check_forkserver_stays_single_threaded_without_cuda_when_children_ran(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    async with host.CheckHost(the_reaper) as h:
        assert h.made == 0 and not h.ready_now  # started by the first use, not at once
        pid = await h.ready()
        assert pid is not None and h.ready_now
        assert h.ready_info["threads"] == 1 and h.ready_info["cuda"] is False
        server = psutil.Process(pid)
        assert "torch" in " ".join(m.path for m in server.memory_maps())  # torch imported
        for _ in range(2):
            results = await suites.bootcheck(settings(0, 1, free_port(), h, tmp_path))
            assert all(r.passed for r in results), results
        assert len(h.forked) == 2 and all(c.exited.done() for c in h.forked)
        assert server.num_threads() == 1  # the gloo threads lived in the children only
        assert server.children() == []  # and the forkserver reaped them


async def test_collectives_start_cold_and_say_so_once_when_no_forkserver_starts(
    the_reaper: reaper.Reaper, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # an interpreter whose forkserver does not start (it runs everything else)
    python = tmp_path / "python"
    forkserver_fails = '[ "$2" = aegis.checks.forkserver ] && exit 3'
    python.write_text(f'#!/bin/sh\n{forkserver_fails}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    broken = host.HostSettings(interpreter=str(python))
    caplog.set_level(logging.WARNING, logger="aegis.checks")
    recording = harness.Recording(the_reaper)  # the one waitpid owner in the agent
    async with host.CheckHost(recording, settings=broken) as h:
        for _ in range(2):
            results = await suites.bootcheck(settings(0, 1, free_port(), h, tmp_path))
            assert all(r.passed for r in results), results
        assert h.disabled and h.forked == [] and await h.ready() is None
    cold = [r for r in caplog.records if "start cold" in r.getMessage()]
    assert len(cold) == 1, caplog.records
    collective = [argv for argv in recording.spawned if "aegis.checks.collective" in argv]
    assert len(collective) == 2  # both cold children started (and reaped) by the reaper


async def test_check_host_replaces_forkserver_when_it_dies_idle(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    async with host.CheckHost(the_reaper) as h:
        first = await h.ready()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await async_wait_until(lambda: h.made == 2, what="a second forkserver")
        second = await h.ready()
        assert second is not None and second != first
        results = await suites.bootcheck(settings(0, 1, free_port(), h, tmp_path))
        assert all(r.passed for r in results), results
        assert len(h.forked) == 1


async def test_warm_child_is_killed_at_budget_and_host_serves_again_when_pod_missing(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    async with host.CheckHost(the_reaper) as h:
        assert await h.ready()
        alone = settings(0, 2, free_port(), h, tmp_path, budget_s=2.0)  # no rank 1
        results = {r.check_type: r for r in await suites.troubleshoot(alone)}
        assert results[CONNECT].result == "timeout after 2 s"
        assert results[PERF].not_applicable and "skipped" in results[PERF].result
        [child] = h.forked
        assert child.exited.done() and os.WIFSIGNALED(child.exited.result())
        assert gone(child.pid)
        results = {
            r.check_type: r
            for r in await suites.troubleshoot(settings(0, 1, free_port(), h, tmp_path))
        }
        assert results[CONNECT].passed and results[PERF].passed
        assert len(h.forked) == 2 and h.made == 1


async def test_a_runtime_check_past_its_budget_leaves_the_child_to_the_collective_checks(
    tmp_path: Path,
) -> None:
    """One child answers a round's runtime and collective checks: a start slower than runtime's
    budget fails runtime only (a slow node), as when runtime ran apart; the child is not killed
    under allreduce_connect, which gets its own budget."""
    slow = settings(0, 1, free_port(), None, tmp_path)
    slow = dataclasses.replace(slow, budgets_s={**slow.budgets_s, CheckType.RUNTIME: 0.001})
    results = {r.check_type: r for r in await suites.bootcheck(slow)}
    assert results[CheckType.RUNTIME].timed_out and not results[CheckType.RUNTIME].passed
    assert results[CONNECT].passed, results[CONNECT]


def test_the_checks_that_need_torch_never_import_it_in_the_agent() -> None:
    """A bootcheck and a check round as the agent runs them (with its warm check interpreter):
    their runtime check reports torch, and the process that ran them never imported it (the
    agent is PID 1 of its pod: no torch's memory there, no CUDA initialised)."""
    script = """
import asyncio, json, sys, tempfile
from pathlib import Path
from aegis.agent import reaper
from aegis.checks import base, host, suites
from aegis.spawn.ports import free_port

async def main():
    scratch = Path(tempfile.mkdtemp())
    async with reaper.Reaper() as the_reaper, host.CheckHost(the_reaper) as h:
        rounds = []
        for run in (suites.bootcheck, suites.troubleshoot):
            info = base.GroupInfo(0, 1, "127.0.0.1", free_port())
            settings = base.CheckSettings(scratch_dir=scratch, group=info, host=h,
                                          perf=base.PerfSettings(compute_s=0.1))
            rounds.append([[r.check_type.value, r.passed, r.result] for r in await run(settings)])
        print(json.dumps({"rounds": rounds, "forked": [c.args[0] for c in h.forked],
                          "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))

asyncio.run(main())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["torch"] == []
    assert out["forked"] == ["runtime,connect", "runtime,connect,perf"]  # one child a round
    for results in out["rounds"]:
        assert all(passed for _, passed, _ in results), results
        [runtime] = [result for check, _, result in results if check == "runtime"]
        report = env.parse_report(runtime)
        assert report is not None and report.torch.startswith("2.13"), runtime


def test_collective_child_prints_a_verdict_per_round_from_one_group_when_both_asked() -> None:
    port = str(free_port())
    argv = [sys.executable, "-m", "aegis.checks.collective", "connect,perf", "--rank", "0",
            "--world-size", "1", "--master-addr", "127.0.0.1", "--master-port", port,
            "--compute-s", "0.1"]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out, _ = child.communicate(timeout=120)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert child.returncode == 0
    assert [x["mode"] for x in lines] == ["connect", "perf"]
    assert lines[0]["pid"] == lines[1]["pid"] == child.pid
    assert all(x["passed"] for x in lines), lines
