"""The supervisor in process, driven as the master link will drive it: restart, hangs, reports."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from aegis.agent import exit_rule, ports, reaper, stacks, supervisor
from tests import agent_waits as waits
from tests.waits import async_wait_until

PYTHON = sys.executable


class Lines:
    """Collects the command's output lines (the observer hook)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def __call__(self, stream: str, line: bytes) -> None:
        self.seen.append(line.decode().rstrip("\n"))

    def with_prefix(self, prefix: str) -> list[str]:
        return [line for line in self.seen if line.startswith(prefix)]


@pytest.fixture
async def the_reaper() -> AsyncIterator[reaper.Reaper]:
    async with reaper.Reaper() as r:
        yield r


_DEVNULL: list[int] = []


@pytest.fixture(autouse=True)
def _close_devnull() -> Iterator[None]:
    yield
    while _DEVNULL:
        os.close(_DEVNULL.pop())


def make(
    argv: list[str],
    the_reaper: reaper.Reaper,
    reports: ports.RecordingReports,
    lines: Lines,
    *,
    grace_s: float = 5.0,
    hang_timeout_s: float = 0.0,
) -> supervisor.Supervisor:
    """A supervisor whose command output goes to /dev/null (the observer still sees each line)."""
    _DEVNULL.append(devnull := os.open(os.devnull, os.O_WRONLY))
    settings = supervisor.SupervisorSettings(
        grace_s=grace_s, hang_timeout_s=hang_timeout_s, stdout_fd=devnull, stderr_fd=devnull
    )
    return supervisor.Supervisor(argv, settings, the_reaper, reports, observe=lines)


async def test_restart_replaces_group_when_ordered(
    the_reaper: reaper.Reaper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOB_VAR", "kept")  # the job's environment, the same in every incarnation
    reports, lines = ports.RecordingReports(), Lines()
    argv = [PYTHON, str(waits.BIN / "report_env.py")]
    async with make(argv, the_reaper, reports, lines, grace_s=5.0) as sup:
        await sup.start()
        await async_wait_until(lambda: len(lines.with_prefix("INCARNATION")) == 1)
        _, count, port, pid, grandchild, job_var = lines.with_prefix("INCARNATION")[0].split()
        assert (count, port, job_var) == ("0", "-", "kept")
        assert psutil.Process(int(pid)).ppid() == os.getpid()

        await sup.restart({"MASTER_PORT": "29501"})
        await async_wait_until(lambda: len(lines.with_prefix("INCARNATION")) == 2)
        _, count2, port2, pid2, grandchild2, job_var2 = lines.with_prefix("INCARNATION")[1].split()
        assert (count2, port2, job_var2) == ("1", "29501", "kept")
        assert sup.restart_count == 1 and sup.pid == int(pid2) != int(pid)
        assert waits.really_gone(int(pid)) and waits.gone(int(grandchild))  # old group gone
        assert psutil.Process(int(pid2)).ppid() == os.getpid()  # same agent, not re-executed
        assert psutil.Process(int(grandchild2)).is_running()

        assert [r.reason for r in reports.exits] == [ports.ExitReason.RESTARTED]
        stopped = await sup.stop()
    assert stopped is not None and stopped.reason is ports.ExitReason.STOPPED
    assert stopped.exit_status == 128 + 15
    await async_wait_until(lambda: waits.gone(int(grandchild2)))


async def test_a_start_cancelled_midway_still_watches_its_child_and_stop_ends_it(
    the_reaper: reaper.Reaper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent is SIGTERMed while it starts the training: the start is cancelled after the
    spawn, while the output pipes open. The child is still watched, so ``stop()`` ends it and
    returns (it waited for ever for an exit nobody watched)."""
    entered, gate = asyncio.Event(), asyncio.Event()
    real_open = supervisor.pump.open_pump

    async def held_open(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await gate.wait()
        return await real_open(*args, **kwargs)

    monkeypatch.setattr(supervisor.pump, "open_pump", held_open)
    reports, lines = ports.RecordingReports(), Lines()
    sup = make([PYTHON, "-c", "import time; time.sleep(600)"], the_reaper, reports, lines)
    await sup.__aenter__()  # not ``async with``: its exit stops too, for ever without the fix
    starting = asyncio.create_task(sup.start())
    await asyncio.wait_for(entered.wait(), 60)
    starting.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await starting
    child = sup.pid
    assert child is not None
    stopping = asyncio.ensure_future(sup.stop())
    ended, _ = await asyncio.wait([stopping], timeout=60)
    if not ended:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, 9)
        pytest.fail("stop() waited for an exit nobody watched")
    await sup.__aexit__(None, None, None)
    report = stopping.result()
    assert report is not None and report.reason is ports.ExitReason.STOPPED
    assert not sup.running


async def test_wait_skips_restarts_when_command_later_exits(the_reaper: reaper.Reaper) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    script = (
        "import os, sys, time\n"
        "print('RUN', os.environ['AEGIS_RESTART_COUNT'], flush=True)\n"
        "if os.environ['AEGIS_RESTART_COUNT'] == '1': sys.exit(9)\n"
        "time.sleep(600)\n"
    )
    async with make([PYTHON, "-c", script], the_reaper, reports, lines) as sup:
        await sup.start()
        await async_wait_until(lambda: "RUN 0" in lines.seen)
        await sup.restart()
        report = await sup.wait()
    assert (report.reason, report.exit_status, report.restart_count) == (
        ports.ExitReason.EXITED,
        9,
        1,
    )


async def test_an_exit_report_carries_the_last_step_and_the_run_remembers_earlier_steps(
    the_reaper: reaper.Reaper,
) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    script = (
        "import os, sys, time, aegis\n"
        "if os.environ['AEGIS_RESTART_COUNT'] == '0':\n"
        "    aegis.progress(5); print('STEPPED', flush=True); time.sleep(600)\n"
        "if os.environ['AEGIS_RESTART_COUNT'] == '1': sys.exit(3)\n"
        "aegis.progress(7); sys.exit(4)\n"
    )
    async with make([PYTHON, "-c", script], the_reaper, reports, lines) as sup:
        await sup.start()
        await async_wait_until(lambda: "STEPPED" in lines.seen, what="a step reported")
        await sup.restart()  # its exit report looks at its last step
        first = await sup.wait()
        assert first.exit_status == 3 and first.step == 0  # no step of its own: from its start
        assert sup.progress() == ports.Progress(ever_stepped=True)  # but the run stepped
        await sup.restart()
        second = await sup.wait()
    assert second.exit_status == 4 and second.step == 7


async def test_start_reports_127_when_command_is_missing(the_reaper: reaper.Reaper) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    async with make(["/nonexistent/aegis-train"], the_reaper, reports, lines) as sup:
        await sup.start()
        report = await sup.wait()
    assert (report.exit_status, report.reason) == (127, ports.ExitReason.SPAWN_FAILED)


async def test_exit_report_carries_evidence_when_command_crashes(
    the_reaper: reaper.Reaper,
) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    script = (
        "import sys\n"
        "print('step 1', flush=True)\n"
        "def all_reduce():\n"
        "    raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "all_reduce()\n"
    )
    async with make([PYTHON, "-c", script], the_reaper, reports, lines) as sup:
        await sup.start()
        report = await sup.wait()
        await reports.wait_for("exits")
    assert report.exit_status == 1
    evidence = report.evidence
    assert evidence.fault_class == ports.FaultClass.CUDA_ERROR
    traceback = [m for m in evidence.matches if m.fault_class == ports.FaultClass.PYTHON_TRACEBACK]
    assert traceback and "in all_reduce" in traceback[0].detail
    assert "step 1" in evidence.last_lines
    assert {f.match.fault_class for f in reports.faults} == {
        ports.FaultClass.CUDA_ERROR,
        ports.FaultClass.PYTHON_TRACEBACK,
    }
    assert reports.exits == [report]


async def test_exit_report_names_segfault_when_command_dies_of_sigsegv(
    the_reaper: reaper.Reaper,
) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    async with make(["bash", "-c", "kill -SEGV $$"], the_reaper, reports, lines) as sup:
        await sup.start()
        report = await sup.wait()
    assert (report.exit_status, report.signal) == (128 + 11, 11)
    assert report.evidence.fault_class == ports.FaultClass.SEGFAULT


def _dying_script(gate: Path, body: str) -> str:
    """Calls aegis.progress (which installs the hook under an agent), runs ``body``; its exit
    waits (atexit) until ``gate`` exists, so a report made before the exit is told apart."""
    return (
        "import atexit, os, sys, time\n"
        "import aegis\n"
        f"gate = {str(gate)!r}\n"
        "def wait_for_gate():\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not os.path.exists(gate) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "atexit.register(wait_for_gate)\n"
        "aegis.progress(1)\n"
        f"{body}\n"
    )


async def test_an_uncaught_exception_is_reported_before_the_process_has_exited(
    the_reaper: reaper.Reaper, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    body = "def train():\n    raise RuntimeError('NCCL error: unhandled system error')\ntrain()"
    reports, lines = ports.RecordingReports(), Lines()
    async with make([PYTHON, "-c", _dying_script(gate, body)], the_reaper, reports, lines) as sup:
        await sup.start()
        pid = sup.pid
        await reports.wait_for("dying")
        assert reports.exits == []  # still in its atexit handler
        [dying] = reports.dying
        assert (dying.pid, dying.restart_count, dying.exception) == (pid, 0, "RuntimeError")
        assert dying.evidence.fault_class == ports.FaultClass.NCCL_ERROR
        traceback = [m for m in dying.evidence.matches if m.signature == "python_traceback"]
        assert traceback and "in train" in traceback[0].detail
        gate.touch()
        report = await sup.wait()
    assert report.exit_status == 1 and reports.exits == [report]
    assert len(reports.dying) == 1
    assert lines.with_prefix("[aegis] exiting on an uncaught RuntimeError")


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ("sys.exit(3)", 3),  # SystemExit is an exit, not a crash
        # a subprocess of the command (an evaluation job) dies; training goes on
        ("import subprocess\nsubprocess.run([sys.executable, '-c', "
         "'import aegis; aegis.progress(1); raise ValueError(1)'])\nprint('survived')", 0),
        # ended by a SIGINT (130, as a signal): its exit tells, not a software fault's report
        ("raise KeyboardInterrupt", 130),
    ],
)  # fmt: skip
async def test_no_early_report_unless_the_commands_own_process_dies_of_an_exception(
    the_reaper: reaper.Reaper, tmp_path: Path, body: str, status: int
) -> None:
    gate = tmp_path / "gate"
    gate.touch()
    reports, lines = ports.RecordingReports(), Lines()
    async with make([PYTHON, "-c", _dying_script(gate, body)], the_reaper, reports, lines) as sup:
        await sup.start()
        report = await sup.wait()
    assert report.exit_status == status
    assert reports.dying == []


async def test_a_forwarded_sigint_is_reported_by_its_exit_not_as_a_crash(
    the_reaper: reaper.Reaper,
) -> None:
    """The agent forwards a SIGINT (``kill -INT``, docker's STOPSIGNAL, srun's ^C ^C); the
    script's KeyboardInterrupt is no uncaught exception of its own (a software fault, exit 1)."""
    script = "import time\nimport aegis\naegis.progress(1)\nprint('READY', flush=True)\n" \
             "while True:\n    time.sleep(0.05)\n"  # fmt: skip
    reports, lines = ports.RecordingReports(), Lines()
    async with make([PYTHON, "-c", script], the_reaper, reports, lines) as sup:
        await sup.start()
        await async_wait_until(lambda: "READY" in lines.seen, what="the script to start")
        sup.send_signal(signal.SIGINT)
        report = await sup.wait()
    assert (report.exit_status, report.signal) == (128 + signal.SIGINT, signal.SIGINT)
    assert lines.with_prefix("KeyboardInterrupt") and reports.dying == []
    assert not lines.with_prefix("[aegis] exiting on an uncaught")
    said = exit_rule.on_exit(report, dying_reported=bool(reports.dying))  # what the link sends
    assert said == exit_rule.Failed("exit status 130", ports.FaultClass.KILLED)


async def test_the_hook_runs_after_the_scripts_own_excepthook(the_reaper: reaper.Reaper) -> None:
    script = (
        "import sys\n"
        "import aegis\n"
        "def mine(kind, value, tb):\n"
        "    print('my hook saw', kind.__name__, file=sys.stderr, flush=True)\n"
        "sys.excepthook = mine\n"
        "aegis.progress(1)  # installs aegis's hook, which calls the one it found\n"
        "raise ValueError('x')\n"
    )
    reports, lines = ports.RecordingReports(), Lines()
    async with make([PYTHON, "-c", script], the_reaper, reports, lines) as sup:
        await sup.start()
        report = await sup.wait()
    assert report.exit_status == 1
    assert [d.exception for d in reports.dying] == ["ValueError"]
    assert lines.seen[-2:] == ["my hook saw ValueError", "[aegis] exiting on an uncaught ValueError"
                               f" (pid {report.pid})"]  # fmt: skip


HANG_TIMEOUT_S = 1.0


@pytest.mark.parametrize("mode", ["progress", "output"])
@pytest.mark.timing
async def test_watchdog_reports_hang_with_stack_when_command_stops_progressing(
    the_reaper: reaper.Reaper, mode: str
) -> None:
    if stacks.find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    reports, lines = ports.RecordingReports(), Lines()
    argv = [PYTHON, str(waits.BIN / "hang.py"), mode]

    def stuck() -> list[ports.HangReport]:
        """The spell that starts when the script hangs: its last activity (the last step, or
        the HANGING line) comes after the script wrote that line. A starved interpreter's
        start can be silent for the timeout too: a right report of an earlier spell, whose
        stack, taken later, may already show stuck_in_allreduce."""
        hanging = lines.with_prefix("HANGING")
        if not hanging:
            return []
        stopped = float(hanging[0].split()[1])
        return [h for h in reports.hangs if h.last_activity_ts >= stopped]

    async with make(argv, the_reaper, reports, lines, hang_timeout_s=HANG_TIMEOUT_S) as sup:
        await sup.start()
        await reports.wait_for("hangs")
        if any(d.error is not None for d in reports.hangs[0].stacks):
            pytest.skip(f"py-spy cannot attach here: {reports.hangs[0].stacks}")
        [hang] = await async_wait_until(stuck, 60, "the report of the script's hang")
        assert sup.running  # reported, not killed
    assert hang.last_step == (5 if mode == "progress" else None)
    [stack] = hang.stacks
    assert "stuck_in_allreduce" in stack.text
    for each in reports.hangs:  # never before the timeout (how soon after: benchmarks/)
        assert each.detected_ts - each.last_activity_ts >= HANG_TIMEOUT_S


@pytest.mark.timing
async def test_watchdog_stays_quiet_when_command_keeps_progressing(
    the_reaper: reaper.Reaper,
) -> None:
    reports, lines = ports.RecordingReports(), Lines()
    script = (
        "import time, aegis\nfor step in range(40):\n    aegis.progress(step); time.sleep(0.05)\n"
    )
    async with make([PYTHON, "-c", script], the_reaper, reports, lines, hang_timeout_s=1.0) as sup:
        await sup.start()
        report = await sup.wait()
    assert report.exit_status == 0
    # no hang once it reports steps (a starved interpreter's start, before its first step,
    # can be silent for the timeout: a hang reported then is right)
    assert [h for h in reports.hangs if h.last_step is not None] == []


async def test_a_stack_dump_cancelled_midway_kills_its_py_spy(
    the_reaper: reaper.Reaper, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog is cancelled when the training restarts or stops, maybe while py-spy dumps
    a stuck process (the hang case). py-spy runs in a process group of its own, which no group
    kill reaches: the cancelled dump kills it (a stand-in that never ends, here)."""
    marker = tmp_path / "spy.pid"
    fake = tmp_path / "py-spy"
    script = f"echo $$ > {marker}.tmp && mv {marker}.tmp {marker}\nexec sleep 600\n"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setattr(stacks, "find_py_spy", lambda: str(fake))
    task = asyncio.create_task(stacks.dump(the_reaper, os.getpid(), timeout_s=600.0))
    await async_wait_until(marker.exists, 60, "py-spy started")
    spy = int(marker.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not psutil.pid_exists(spy)  # killed and reaped, not left running
