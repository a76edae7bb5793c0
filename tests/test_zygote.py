"""Warm starts from a zygote: a warm child sees and does what a cold child of the command does."""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from aegis.agent import ports, pycmd, reaper, supervisor, warm, watchdog
from tests import agent_waits as waits
from tests import forkserver_harness as harness
from tests.waits import async_wait_until, wait_until

the_reaper, devnull, subreaper = harness.the_reaper, harness.devnull, harness.subreaper  # fixtures

PYTHON = sys.executable
PROBE = str(waits.BIN / "probe_main.py")


async def next_zygote_ready(sup: supervisor.Supervisor) -> None:
    """Wait until the zygote for the next start (the second one made) is ready."""
    zygotes = sup.zygotes
    assert zygotes is not None
    await async_wait_until(lambda: zygotes.made == 2, what="the next zygote")
    assert await zygotes.ready() is not None


def comparable(seen: dict[str, Any]) -> dict[str, Any]:
    seen = dict(seen)
    seen.pop("ppid")
    per_supervisor = (supervisor.RESTART_COUNT_VAR, "AEGIS_PROGRESS_FILE")
    seen["env"] = {k: v for k, v in seen["env"].items() if k not in per_supervisor}
    return seen


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python3", "train.py", "--lr", "1"], ("train.py", None, (), ("--lr", "1"))),
        (["python", "-u", "-X", "dev", "-m", "pkg.mod", "a"],
         (None, "pkg.mod", ("-u", "-X", "dev"), ("a",))),
        ([PYTHON, "-Wignore", "t.py"], ("t.py", None, ("-Wignore",), ())),
        (["bash", "-c", "python train.py"], None),
        (["torchrun", "--nproc-per-node", "4", "train.py"], None),
        (["python", "-c", "print(1)"], None),
        (["python"], None),
    ],
)  # fmt: skip
def test_pycmd_recognises_python_commands_when_parsing_argv(
    argv: list[str], expected: tuple[object, ...] | None
) -> None:
    command = pycmd.parse(argv, os.environ)
    if expected is None:
        assert command is None
    else:
        assert command is not None
        assert (command.script, command.module, command.options, command.args) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, warm.PrewarmSettings()),
        ("auto", warm.PrewarmSettings()),
        ("0", None),
        ("off", None),
        ("torch, numpy", warm.PrewarmSettings(modules=("torch", "numpy"))),
    ],
)
def test_prewarm_settings_follow_env_when_parsed(
    value: str | None, expected: warm.PrewarmSettings | None
) -> None:
    assert warm.settings_from(value) == expected


@pytest.mark.parametrize("value", ["torch numpy", "torch,3d", "torch;os", "a..b", "torch,."])
def test_prewarm_that_names_no_module_is_refused(value: str) -> None:
    with pytest.raises(warm.PrewarmError, match="not a module name"):
        warm.settings_from(value)
    assert warm.settings_from("torch.nn, _private,é") == warm.PrewarmSettings(
        modules=("torch.nn", "_private", "é")
    )


@pytest.mark.parametrize(
    ("action", "status"),
    [(["exit", "3"], 3), (["raise"], 1), (["kill", "9"], 137), (["exit", "0"], 0)],
)
async def test_warm_child_sees_what_cold_child_sees_when_script_is_run(
    the_reaper: reaper.Reaper, devnull: int, action: list[str], status: int
) -> None:
    (cold, *warms), (first, *others) = await harness.cold_then_warm(
        [PYTHON, PROBE, *action], the_reaper, devnull
    )
    assert [cold.exit_status, *(w.exit_status for w in warms)] == [status] * 3
    assert first["ppid"] == os.getpid() and first["env"][supervisor.RESTART_COUNT_VAR] == "0"
    for count, second in enumerate(others):
        assert second["env"][supervisor.RESTART_COUNT_VAR] == str(count)
        assert second["ppid"] != os.getpid()  # forked by a zygote
        assert comparable(first) == comparable(second)
        assert second["name"] == "__main__" and second["main_is_us"] and second["pgid_is_pid"]
        assert second["argv"] == [PROBE, *action] and second["threads"] == 1


async def test_warm_child_sees_what_cold_child_sees_when_module_is_run(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    env = harness.with_path(str(waits.BIN))
    argv = [PYTHON, "-m", "probe_main", "exit", "5"]
    reports, (first, *others) = await harness.cold_then_warm(argv, the_reaper, devnull, env=env)
    assert [r.exit_status for r in reports] == [5, 5, 5]
    for second in others:
        assert second["ppid"] != os.getpid()  # forked by a zygote
        assert comparable(first) == comparable(second)
        assert second["argv"] == [PROBE, "exit", "5"] and second["path0"] == os.getcwd()


async def test_warm_child_gets_signals_progress_and_scanner_when_running(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    sup, reports, _ = harness.make([PYTHON, PROBE, "progress", "7"], the_reaper, devnull)
    async with sup:
        await sup.start()
        await async_wait_until(lambda: sup.last_step == 7)
        await next_zygote_ready(sup)
        await sup.restart()
        await reports.wait_for("faults", 2)
        await async_wait_until(lambda: sup.last_step == 7)
        pid = sup.pid
        assert pid is not None and os.getpgid(pid) == pid
        assert psutil.Process(pid).ppid() != os.getpid()  # warm: forked by the zygote
        sup.send_signal(signal.SIGUSR1)
        report = await sup.wait()
    assert (report.exit_status, report.signal, report.restart_count) == (128 + 10, 10, 1)
    assert [f.restart_count for f in reports.faults] == [0, 1]
    assert reports.faults[1].match.signature == "cuda_error"
    assert waits.really_gone(pid)


async def test_stop_terminates_warm_group_when_ordered(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    sup, _, lines = harness.make([PYTHON, PROBE, "pause"], the_reaper, devnull)
    async with sup:
        await sup.start()
        await async_wait_until(lambda: len(lines.json("PROBE")) == 1)
        await next_zygote_ready(sup)
        await sup.restart()
        await async_wait_until(lambda: len(lines.json("PROBE")) == 2)
        pid = sup.pid
        stopped = await sup.stop()
    assert stopped is not None and stopped.reason is ports.ExitReason.STOPPED
    assert stopped.exit_status == 128 + signal.SIGTERM
    assert pid is not None and waits.really_gone(pid)


async def test_warm_child_leaves_no_zombies_when_it_leaves_orphans(
    the_reaper: reaper.Reaper, devnull: int, subreaper: None
) -> None:
    argv = [PYTHON, str(waits.BIN / "zombies.py")]
    reports, seen = await harness.cold_then_warm(argv, the_reaper, devnull, prefix="READY")
    assert [r.exit_status for r in reports] == [3, 3, 3] and len(seen) == 3
    for ready in seen:
        assert ready["parent"] == os.getpid()  # orphans come to the agent, not to the nanny
        for pid in [*ready["zombies"], ready["orphan"]]:
            gone = functools.partial(waits.really_gone, pid)
            await async_wait_until(gone, what=f"{pid} reaped")
    zombies = [p for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


async def test_zygote_never_initialises_cuda_or_threads_when_torch_is_prewarmed(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    modules = ("torch", "torch.distributed")
    sup, _, lines = harness.make([PYTHON, PROBE, "exit", "0"], the_reaper, devnull, modules=modules)
    async with sup:
        assert sup.zygotes is not None
        sup.zygotes.prepare()
        zygote = await sup.zygotes.ready()
        assert zygote is not None
        # what the zygote saw just before it said ready, and what it is now, waiting to fork
        assert zygote.info["modules"] == ["torch", "torch.distributed"]
        assert zygote.info["threads"] == 1 and zygote.info["cuda"] is False
        assert len(psutil.Process(zygote.pid).threads()) == 1
        await sup.start()
        assert (await sup.wait()).exit_status == 0
    warm_child = lines.json("PROBE")[0]
    assert warm_child["ppid"] == zygote.pid and warm_child["threads"] == 1


async def test_zygote_drops_module_when_it_starts_a_thread(
    the_reaper: reaper.Reaper, devnull: int, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    libraries = tmp_path / "site-packages"  # a library (the job's own code is never prewarmed)
    libraries.mkdir()
    (libraries / "starts_thread.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n"
    )
    env = harness.with_path(str(libraries))
    modules = ("json", "starts_thread")
    sup, _, _ = harness.make([PYTHON, PROBE], the_reaper, devnull, modules=modules, env=env)
    async with sup:
        assert sup.zygotes is not None
        sup.zygotes.prepare()
        zygote = await sup.zygotes.ready()
        assert zygote is not None and zygote.info["modules"] == ["json"]
        assert sup.zygotes.made == 2
    assert "starts_thread" in caplog.text


async def test_command_starts_cold_when_it_is_not_python(
    the_reaper: reaper.Reaper, devnull: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    sup, _, lines = harness.make(["bash", "-c", f"{PYTHON} {PROBE} exit 4"], the_reaper, devnull)
    async with sup:
        assert sup.zygotes is None
        await sup.start()
        assert (await sup.wait()).exit_status == 4
        await sup.restart()
        assert (await sup.wait()).exit_status == 4
    assert caplog.text.count("cold starts") == 1
    assert len(lines.json("PROBE")) == 2


async def test_dead_zygote_is_replaced_when_it_dies_idle(
    the_reaper: reaper.Reaper, devnull: int
) -> None:
    sup, _, lines = harness.make([PYTHON, PROBE, "exit", "0"], the_reaper, devnull)
    async with sup:
        assert sup.zygotes is not None
        zygotes = sup.zygotes
        zygotes.prepare()
        first = await zygotes.ready()
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        await async_wait_until(lambda: zygotes.made == 2, what="a second zygote")
        second = await zygotes.ready()
        assert second is not None and second.pid != first.pid
        await sup.start()
        assert (await sup.wait()).exit_status == 0
    assert lines.json("PROBE")[0]["ppid"] == second.pid
    assert waits.really_gone(first.pid)


async def test_warm_child_dies_with_its_nanny_when_nanny_is_killed(
    the_reaper: reaper.Reaper, devnull: int, subreaper: None
) -> None:
    sup, _, lines = harness.make([PYTHON, PROBE, "pause"], the_reaper, devnull)
    async with sup:
        await sup.start()
        await async_wait_until(lambda: len(lines.json("PROBE")) == 1)
        child = lines.json("PROBE")[0]
        child_pid = sup.pid
        assert child["comm"] == Path(PYTHON).name[:15]  # the name a cold start shows
        nanny = psutil.Process(child["ppid"])
        assert nanny.name() == "aegis-nanny"
        nanny.kill()
        report = await sup.wait()
    assert (report.exit_status, report.signal) == (128 + 9, 9)  # never an unknown exit
    assert report.pid == child_pid
    await async_wait_until(lambda: waits.really_gone(child_pid), what="the child reaped")


_AGENT_THEN_DIE = """
import asyncio, os, sys
from aegis.agent import ports, reaper, supervisor, warm

async def main() -> None:
    settings = supervisor.SupervisorSettings(prewarm=warm.PrewarmSettings(modules=("json",)))
    async with reaper.Reaper() as r:
        reports = ports.RecordingReports()
        async with supervisor.Supervisor(sys.argv[1:], settings, r, reports) as sup:
            sup.zygotes.prepare()
            print((await sup.zygotes.ready()).pid, flush=True)
            os._exit(0)

asyncio.run(main())
"""


def test_idle_zygote_dies_with_its_agent_when_agent_ends_abruptly() -> None:
    agent = subprocess.Popen([PYTHON, "-c", _AGENT_THEN_DIE, PYTHON, PROBE], stdout=subprocess.PIPE)
    line = waits.read_line_with(agent, "")
    assert agent.wait(timeout=30) == 0
    wait_until(lambda: waits.gone(int(line)), what="the zygote gone with its agent")
    # its progress file outlives it; the next agent on the host removes it (and nothing is left)
    removed = watchdog.sweep_dead_owners(watchdog.progress_dir())
    assert [n for n in removed if (watchdog.owner_of(n) or (0, 0, 0))[1] == agent.pid], removed


def test_a_warm_rank_waits_for_rank_0s_store_only_as_long_as_it_must() -> None:
    """A rank other than 0 starts its script once MASTER_ADDR:MASTER_PORT listens (torch's
    client would back off for most of a second otherwise); rank 0, a job without a master
    address, or a port nobody opens within the bound, do not hold the script up."""
    import socket

    from aegis.agent.zygote import await_rendezvous

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = str(listener.getsockname()[1])
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "2"}
        assert await_rendezvous(env, deadline_s=5.0)
        assert not await_rendezvous({**env, "RANK": "0"}, deadline_s=5.0)
    assert not await_rendezvous({"RANK": "1"}, deadline_s=5.0)
    with socket.socket() as closed:  # bound, never listening: refused until the deadline
        closed.bind(("127.0.0.1", 0))
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed.getsockname()[1]), "RANK": "1"}
        assert not await_rendezvous(env, deadline_s=0.05)
