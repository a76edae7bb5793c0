"""allreduce_connect / allreduce_perf: real pods (processes) in a real gloo group; the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from itertools import combinations

import psutil
import pytest

from aegis.checks import base, group, links, perf, suites
from aegis.cli import main as cli
from aegis.core.recovery import CheckType
from aegis.spawn.ports import free_port
from aegis.wire.messages import CheckResult
from tests.waits import async_wait_until

PY = sys.executable


def settings(rank: int, world: int, port: int, budget_s: float = 60.0) -> base.CheckSettings:
    budgets = {CheckType.ALLREDUCE_CONNECT: budget_s, CheckType.ALLREDUCE_PERF: budget_s}
    return base.CheckSettings(
        group=base.GroupInfo(rank, world, "127.0.0.1", port),
        budgets_s={**base.DEFAULT_BUDGETS_S, **budgets},
        perf=base.PerfSettings(compute_s=0.3),
    )


async def connect(rank: int, world: int, port: int, budget_s: float = 60.0) -> CheckResult:
    return await base.run_one(
        CheckType.ALLREDUCE_CONNECT,
        group.allreduce_connect_check,
        settings(rank, world, port, budget_s),
    )


def collective_children() -> list[psutil.Process]:
    """Live collective children (a killed one not reaped yet is a zombie: it is gone)."""
    live = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "aegis.checks.collective" in p.cmdline():
                live.append(p)
        except psutil.Error:
            continue
    return live


async def test_allreduce_connect_passes_when_three_pods_join() -> None:
    port = free_port()
    results = await asyncio.gather(*(connect(rank, 3, port) for rank in range(3)))
    assert all(r.passed for r in results), results
    assert results[0].result == "all_reduce and all_gather exact across 3 pod(s)"


async def test_allreduce_connect_fails_with_timeout_when_one_pod_is_missing() -> None:
    port = free_port()
    results = await asyncio.gather(connect(0, 3, port, 3.0), connect(1, 3, port, 3.0))
    assert [r.passed for r in results] == [False, False]
    assert all(r.result == "timeout after 3 s" for r in results), results
    await async_wait_until(  # killed at the budget: nothing left behind
        lambda: not collective_children(), what="no check child left", seen=collective_children
    )


def duty_cycle(pgid: int, stop: threading.Event, stopped_s: float, period_s: float) -> None:
    """Slow a pod from outside: its process group is stopped ``stopped_s`` of every period."""
    while not stop.is_set():
        try:
            os.killpg(pgid, signal.SIGSTOP)
            stop.wait(stopped_s)
            os.killpg(pgid, signal.SIGCONT)
        except ProcessLookupError:
            return
        stop.wait(period_s - stopped_s)


@pytest.mark.timing
def test_allreduce_perf_names_the_slowed_pod_slow_when_duty_cycled() -> None:
    port = free_port()
    pods = [
        subprocess.Popen(
            [
                PY,
                "-m",
                "aegis.cli.main",
                "check",
                "allreduce_perf",
                "--json",
                "--rank",
                str(rank),
                "--world-size",
                "3",
                "--master-port",
                str(port),
                "--slow-factor",
                "0.5",
            ],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(3)
    ]
    stop = threading.Event()
    slower = threading.Thread(target=duty_cycle, args=(pods[2].pid, stop, 0.04, 0.05))
    slower.start()
    try:
        outs = [pod.communicate(timeout=120)[0] for pod in pods]
    finally:
        stop.set()
        slower.join()
        for pod in pods:
            if pod.poll() is None:
                os.killpg(pod.pid, signal.SIGCONT)
                pod.kill()
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [pod.returncode for pod in pods] == [0, 0, 1], reports
    assert reports[2]["result"].startswith("slow (below 0.5x of peers): compute "), reports[2]
    assert "GFLOP/s" in reports[2]["result"] and "MB/s" in reports[2]["result"]
    assert "slow" not in reports[0]["result"]


def test_perf_judge_localises_slow_pod_when_two_pods() -> None:
    assert perf.judge([100.0, 30.0], [500.0, 500.0], 1, 0.6).slow
    assert not perf.judge([100.0, 30.0], [500.0, 500.0], 0, 0.6).slow
    slow_pair = perf.judge([100.0, 100.0, 100.0], [900.0, 880.0, 200.0], 2, 0.6, 0.35)
    assert slow_pair.slow and "best pair 200 MB/s = 0.22x" in slow_pair.text
    assert not perf.judge([100.0], [0.0], 0, 0.6).slow
    assert not perf.judge([100.0, 100.0, 100.0], [900.0, 880.0, 450.0], 2, 0.6, 0.35).slow


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_pairing_is_a_matching_and_meets_distinct_partners_when_rounds_repeat(world: int) -> None:
    met: set[tuple[int, int]] = set()
    for r in range(links.rounds(world, max_rounds=world)):
        partners = links.pairing(world, r)
        assert all(partners[partners[a]] == a and partners[a] != a for a in partners)
        assert len(partners) == world - world % 2
        met |= {(min(a, b), max(a, b)) for a, b in partners.items()}
    assert met == set(combinations(range(world), 2))


async def test_troubleshoot_includes_collectives_when_group_is_given(tmp_path: object) -> None:
    s = settings(0, 1, free_port())
    results = await suites.troubleshoot(s)
    assert [r.check_type for r in results] == list(suites.TROUBLESHOOT)
    assert all(r.passed for r in results), results
    boot = await suites.bootcheck(s)
    assert [r.check_type for r in boot] == [CheckType.RUNTIME, CheckType.ALLREDUCE_CONNECT]


def test_check_cli_exits_by_verdict_and_rejects_unknown_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["check", "hang", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["check"] == "hang" and line["passed"] is True
    assert cli.main(["check", "gpu"]) == 0  # not applicable counts as a pass
    assert capsys.readouterr().out.startswith("n/a  gpu")
    assert cli.main(["check", "gpu", "--require-gpu"]) == 1
    assert cli.main(["check", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown check 'bogus'" in err


async def test_troubleshoot_skips_perf_when_connect_fails() -> None:
    s = settings(0, 2, free_port(), budget_s=2.0)  # the other pod never comes
    results = {r.check_type: r for r in await suites.troubleshoot(s)}
    assert results[CheckType.ALLREDUCE_CONNECT].result == "timeout after 2 s"
    perf_result = results[CheckType.ALLREDUCE_PERF]
    assert perf_result.not_applicable and "skipped" in perf_result.result


def test_perf_compute_runs_on_the_gpu_with_a_gpu_sized_product_when_the_group_is_on_cuda() -> None:
    """On a GPU node the compute benchmark multiplies on the GPU the collectives use, with
    products large enough to measure it, each waited for (checked for real on an H200, see
    benchmarks/RESULTS.md; here a stand-in records what torch is asked)."""
    import types

    from aegis.checks import perf

    calls: list[tuple[str, object]] = []

    class FakeTorch:
        cuda = types.SimpleNamespace(synchronize=lambda device: calls.append(("sync", device)))

        @staticmethod
        def randn(*shape: int, device: object = None) -> tuple[int, ...]:
            calls.append(("randn", (shape, device)))
            return shape

        @staticmethod
        def mm(a: object, b: object) -> None:
            calls.append(("mm", a))

    gpu = types.SimpleNamespace(type="cuda", index=0)
    flops = perf._compute(FakeTorch, 128, seconds=0.02, window_s=0.01, device=gpu)
    assert flops > 0
    assert calls[0] == ("randn", ((perf.GPU_MATRIX, perf.GPU_MATRIX), gpu))
    products = [c for c in calls if c[0] == "mm"]
    assert products and len([c for c in calls if c[0] == "sync"]) == len(products)
    calls.clear()
    perf._compute(FakeTorch, 128, seconds=0.02, window_s=0.01, device=None)  # the CPU
    assert calls[0] == ("randn", ((128, 128), None))
    assert not any(c[0] == "sync" for c in calls)


async def test_a_suspect_whose_node_fails_answers_without_joining_its_peers() -> None:
    """The suspect's node is checked first: its gpu fails, so it answers at once with the
    collective checks skipped (its peer never comes: it would have waited for the budget)."""
    s = dataclasses.replace(
        settings(0, 2, free_port(), budget_s=120.0), suspect=True, inject=frozenset({"gpu"})
    )
    results = await asyncio.wait_for(suites.troubleshoot(s), timeout=60.0)
    by_type = {r.check_type: r for r in results}
    assert not by_type[CheckType.GPU].passed
    for check in (CheckType.ALLREDUCE_CONNECT, CheckType.ALLREDUCE_PERF):
        assert by_type[check].not_applicable, by_type[check]
        assert "own checks failed first (hardware)" in by_type[check].result
    assert [r.check_type for r in results][-2:] == [
        CheckType.ALLREDUCE_CONNECT,
        CheckType.ALLREDUCE_PERF,
    ]
    assert collective_children() == []


async def test_a_suspect_whose_node_passes_joins_the_collectives_after_its_own_checks() -> None:
    s = dataclasses.replace(settings(0, 1, free_port()), suspect=True)
    results = await suites.troubleshoot(s)
    order = [r.check_type for r in results]
    assert order[-2:] == [CheckType.ALLREDUCE_CONNECT, CheckType.ALLREDUCE_PERF]
    assert set(order) == set(suites.TROUBLESHOOT)
    assert all(
        r.passed and not r.not_applicable for r in results if r.check_type in suites.COLLECTIVE
    )


async def test_a_suspect_only_slow_still_joins_the_collectives() -> None:
    """A held-hung suspect fails only its hang check (slow: it leaves at a checkpoint, not now):
    the round waits for its peers, so it must meet them."""
    s = dataclasses.replace(settings(0, 1, free_port()), suspect=True, hung=True)
    by_type = {r.check_type: r for r in await suites.troubleshoot(s)}
    assert not by_type[CheckType.HANG].passed
    assert by_type[CheckType.ALLREDUCE_CONNECT].passed
    assert not by_type[CheckType.ALLREDUCE_CONNECT].not_applicable


@pytest.mark.parametrize("slow_side", [0, 1])
def test_both_sides_of_a_link_measure_with_the_buffer_the_lower_rank_sized(slow_side: int) -> None:
    """Each side of a pair has its own view of the link's rate (here one saw 100 kB/s, the
    other nothing yet): the lower rank sizes the buffer and tells its partner, so both move the
    same one (sizes that differ would leave gloo's send and recv waiting on each other)."""
    port = free_port()
    script = os.path.join(os.path.dirname(__file__), "bin", "links_pair.py")
    rates = ["1e5" if rank == slow_side else "none" for rank in range(2)]
    pods = [
        subprocess.Popen(
            [PY, script, str(rank), str(port), rates[rank]],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [pod.communicate(timeout=120)[0] for pod in pods]
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
    assert [pod.returncode for pod in pods] == [0, 0], outs
    said = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert said[0]["own"] != said[1]["own"]  # the two views differ
    assert said[0]["floats"] == said[1]["floats"] == said[0]["own"], said
