"""The watchdog's calibrated timeout (``agent.hang_policy``, pure) and its two probes of the
process tree (``watchdog.TreeActivity``: CPU use of real processes)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from aegis.agent import hang_policy as hp
from aegis.agent import watchdog
from tests.waits import wait_until

POLICY = hp.HangPolicy()


def stepped(interval: float, steps: int = 50, first: float = 4.0) -> hp.StepHistory:
    history = hp.StepHistory()
    hp.record_step(history, 0.0, None, (1, first))
    for step in range(2, steps + 1):
        hp.record_step(history, 0.0, (step - 1, first + (step - 2) * interval),
                       (step, first + (step - 1) * interval))  # fmt: skip
    return history


def look(now: float, *, step: float | None, output: float = 0.0, cpu: float = 0.0,
         cuda: bool = False, hold: float = 0.0) -> hp.Idle:  # fmt: skip
    return hp.Idle(now, 0.0, step, output, cpu, cuda, hold)


def test_a_fast_job_gets_the_floor_and_a_slow_one_ten_times_its_p99_step() -> None:
    fast, slow = stepped(0.05), stepped(6.0)
    assert hp.step_timeout(POLICY, fast)[0] == 30.0
    assert "floor 30 s" in hp.step_timeout(POLICY, fast)[1]
    timeout, why = hp.step_timeout(POLICY, slow)
    assert timeout == pytest.approx(60.0) and why.startswith("10 x p99 step 6 s")
    assert hp.step_timeout(POLICY, stepped(100.0))[0] == 600.0  # the ceiling
    assert hp.step_timeout(POLICY, hp.StepHistory())[0] == 600.0  # nothing seen yet


def test_a_stall_after_steps_is_a_hang_at_the_timeout_not_before() -> None:
    history = stepped(0.05)
    assert not hp.judge(POLICY, history, look(129.0, step=100.0)).hung  # 29 s
    verdict = hp.judge(POLICY, history, look(130.5, step=100.0))
    assert verdict.hung and verdict.rule == "step" and verdict.idle_s == pytest.approx(30.5)


def test_several_steps_between_two_looks_count_as_their_mean_interval() -> None:
    history = hp.StepHistory()
    hp.record_step(history, 0.0, None, (1, 2.0))
    hp.record_step(history, 0.0, (1, 2.0), (11, 3.0))
    assert list(history.intervals) == [pytest.approx(0.1)]
    assert history.first_steps == [2.0]


def test_a_cpu_busy_stall_waits_for_the_ceiling_unless_cuda_is_loaded() -> None:
    """A long evaluation or save on the CPU is work; a CUDA rank in a stuck NCCL collective
    spins a CPU, so there CPU use proves nothing."""
    history = stepped(0.05)
    busy = hp.judge(POLICY, history, look(200.0, step=100.0, cpu=199.0))
    assert not busy.hung and busy.rule == "busy"
    assert hp.judge(POLICY, history, look(701.0, step=100.0, cpu=700.0)).hung  # the ceiling
    assert hp.judge(POLICY, history, look(200.0, step=100.0, cpu=199.0, cuda=True)).hung


def test_the_first_step_after_a_restart_gets_ten_times_the_slowest_first_step() -> None:
    history = stepped(0.05, first=9.0)
    verdict = hp.judge(POLICY, history, look(89.0, step=None))
    assert not verdict.hung and verdict.timeout_s == pytest.approx(90.0)
    assert verdict.rule == "first" and hp.judge(POLICY, history, look(91.0, step=None)).hung


def test_without_any_step_signal_only_silence_and_an_idle_cpu_are_a_hang() -> None:
    """A rank that prints nothing while it computes is never reported; one idle for 60 s is."""
    none = hp.StepHistory()
    assert not hp.judge(POLICY, none, look(500.0, step=None, output=0.0, cpu=499.0)).hung
    assert not hp.judge(POLICY, none, look(500.0, step=None, output=499.0, cpu=0.0)).hung
    verdict = hp.judge(POLICY, none, look(500.0, step=None, output=420.0, cpu=430.0))
    assert verdict.hung and verdict.rule == "quiet" and verdict.idle_s == pytest.approx(70.0)


def test_an_explicit_timeout_wins_and_a_hold_after_a_requested_checkpoint_never_is_a_hang() -> None:
    fixed = hp.HangPolicy(fixed_s=5.0)
    assert hp.judge(fixed, stepped(60.0), look(106.0, step=100.0)).hung
    assert hp.judge(fixed, hp.StepHistory(), look(6.0, step=None, output=0.5)).hung
    held = hp.judge(POLICY, stepped(0.05), look(140.0, step=100.0, hold=150.0))
    assert not held.hung and held.rule == "hold"
    after = hp.judge(POLICY, stepped(0.05), look(151.0, step=100.0, hold=150.0))
    assert not after.hung  # the stall is timed from the hold's end
    with pytest.raises(ValueError):
        hp.HangPolicy(fixed_s=0.0)
    assert hp.flag(None) == [] and hp.flag(7.0) == ["--hang-timeout-s", "7.0"]


SPIN = """
import sys, time
end = time.monotonic() + 60
while sys.argv[1] == "busy" and time.monotonic() < end:
    pass
time.sleep(30)
"""


def _activity(proc: subprocess.Popen[bytes]) -> watchdog.TreeActivity:
    return watchdog.TreeActivity(lambda: [psutil.Process(proc.pid)], -100.0)


def _sampled(activity: watchdog.TreeActivity) -> watchdog.TreeActivity:
    """One look on the real clock (the activity itself takes a sample at most once a second)."""
    activity.sample(time.monotonic())
    return activity


@pytest.mark.timing
def test_tree_activity_sees_a_busy_process_and_not_a_sleeping_one() -> None:
    """Busy is CPU seconds per second of the real clock: a spinning process is seen busy however
    loaded the machine (it is sampled until it is, and gets far more than 5 % of a core at the
    load the suite must pass under), a sleeping one never is in 4 s of looks."""
    procs = {
        kind: subprocess.Popen([sys.executable, "-c", SPIN, kind]) for kind in ("busy", "idle")
    }
    try:
        busy = procs["busy"]
        wait_until(lambda: psutil.Process(busy.pid).cpu_times().user > 0.2, 30, "busy spins")
        activity = _activity(busy)
        wait_until(lambda: _sampled(activity).last_busy > 0, 25, "seen busy")
        assert not activity.cuda
        idle = procs["idle"]
        wait_until(
            lambda: psutil.Process(idle.pid).status() == psutil.STATUS_SLEEPING, 30, "asleep"
        )
        quiet, end = _activity(idle), time.monotonic() + 4.0
        while time.monotonic() < end:
            _sampled(quiet)
            time.sleep(0.1)  # paces the looks; the activity samples once a second
        assert quiet.last_busy == -100.0  # never busy
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


async def test_the_watchdog_tells_a_hang_with_no_step_signal_and_when_it_moved_again() -> None:
    """The watch loop (real progress file, a process tree of none: no CPU): a silence past
    ``quiet_s`` with no step seen is reported as judged with no step signal (the master lets
    such reports wait for a pod still at work), and the watchdog's hang ends when output comes
    again (the heartbeats tell it: the master withdraws the report)."""
    import asyncio

    from aegis.agent import ports
    from tests.waits import async_wait_until

    started = time.monotonic()
    output = [started]
    reports: list[ports.HangReport] = []
    hung: list[bool] = []

    async def collect() -> tuple[ports.StackDump, ...]:
        return ()

    async def report(hang: ports.HangReport) -> None:
        reports.append(hang)

    policy = hp.HangPolicy(quiet_s=0.5)
    progress = watchdog.ProgressFile()
    task = asyncio.create_task(watchdog.watch(
        watchdog.WatchSettings(policy, 0, started), hp.StepHistory(), progress,
        lambda: output[0], watchdog.TreeActivity(lambda: [], started), collect, report,
        hung.append,
    ))  # fmt: skip
    try:
        await async_wait_until(lambda: reports, 30, "the quiet hang reported")
        assert reports[0].no_step_signal and reports[0].last_step is None
        assert hung == [True]
        output[0] = time.monotonic() + 3600.0  # it prints again (and stays heard)
        await async_wait_until(lambda: hung == [True, False], 30, "the hang over")
    finally:
        task.cancel()
        progress.close()
