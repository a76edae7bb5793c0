"""aegis.progress(): a no-op without an agent, one write into the shared file under one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import aegis
from aegis import training as progress
from aegis.agent import ports, reaper, stacks, watchdog
from aegis.spawn import owners


def test_progress_does_nothing_when_not_under_agent() -> None:
    code = "import aegis; aegis.progress(1); aegis.progress(2); print('ok')"
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout == "ok\n"


def test_progress_writes_step_when_agent_file_is_named() -> None:
    shared = watchdog.ProgressFile()
    try:
        assert shared.read() is None
        code = (
            "import aegis, time; t = time.monotonic(); aegis.progress(41); aegis.progress(42); "
            "print(t)"
        )
        env = {"PATH": "/usr/bin:/bin", progress.ENV_VAR: shared.path}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        seen = shared.read()
        assert seen is not None
        step, ts = seen
        assert step == 42 and ts >= float(result.stdout)
        shared.reset()
        assert shared.read() is None
    finally:
        shared.close()


def test_a_killed_agents_progress_file_is_removed_by_the_next_agent_and_a_live_ones_kept() -> None:
    """A SIGKILLed agent cannot remove its progress file; the next one made on the host does,
    and leaves alone the file of an agent still alive and every file it did not name."""
    made = "from aegis.agent import watchdog; import sys, time; f = watchdog.ProgressFile(); " \
           "print(f.path, flush=True); sys.stdin.read(); f.close()"  # fmt: skip
    killed, alive = (
        subprocess.Popen(
            [sys.executable, "-c", made], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    )
    assert killed.stdout is not None and alive.stdout is not None
    killed_path, alive_path = killed.stdout.readline().strip(), alive.stdout.readline().strip()
    foreign = os.path.join(os.path.dirname(killed_path), f"{watchdog.PROGRESS_PREFIX}not-owned")
    Path(foreign).touch()
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert os.path.exists(killed_path) and os.path.exists(alive_path)
    shared = watchdog.ProgressFile()
    try:
        assert not os.path.exists(killed_path)
        assert os.path.exists(alive_path) and os.path.exists(foreign)
    finally:
        shared.close()
        os.unlink(foreign)
        alive.communicate("", timeout=30)  # it ends and removes its own
    assert not os.path.exists(alive_path) and not os.path.exists(shared.path)


def test_a_progress_file_is_stale_only_when_its_agent_of_this_pid_namespace_is_gone() -> None:
    """A name says the agent by pid namespace, pid and start in ticks since boot (an older
    version's, by its start in ms since the epoch: still judged, as it was)."""
    name = f"{watchdog.PROGRESS_PREFIX}4026531836-812-t59012-x1y2"
    assert watchdog.owner_of(name) == (4026531836, 812, 59012, True)
    older = f"{watchdog.PROGRESS_PREFIX}4026531836-812-1764662400123-x1y2"
    assert watchdog.owner_of(older) == (4026531836, 812, 1764662400123, False)
    assert watchdog.owner_of(f"{watchdog.PROGRESS_PREFIX}q9ncvy54") is None  # an older name
    assert watchdog.owner_of("aegis-drain-0-abc") is None
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )  # lives until its stdin closes
    assert child.stdin is not None
    ns, pid, ticks = owners.pid_ns(), child.pid, owners.start_ticks(child.pid) or 0
    started = owners.started_ms(pid) or 0
    assert not watchdog.stale(watchdog.Owner(ns, pid, ticks, True))  # its agent lives
    assert not watchdog.stale(watchdog.Owner(ns, pid, started, False))
    assert watchdog.stale(watchdog.Owner(ns, pid, ticks + 1, True))  # the pid: another's now
    child.stdin.close()
    child.wait(60)
    assert watchdog.stale(watchdog.Owner(ns, pid, ticks, True))  # no such process
    assert watchdog.stale(watchdog.Owner(ns, pid, started, False))
    assert not watchdog.stale(watchdog.Owner(ns + 1, pid, ticks, True))  # not of our namespace
    assert not watchdog.stale(watchdog.Owner(ns + 1, pid, started, False))


def test_progress_is_callable_in_process_when_module_is_imported() -> None:
    aegis.progress(1)  # no agent in the test runner's environment, or a harmless write


async def test_stack_dump_explains_when_py_spy_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(stacks, "find_py_spy", lambda: None)
    async with reaper.Reaper() as the_reaper:
        dump = await stacks.dump(the_reaper, 1)
    assert dump == ports.StackDump(1, dump.cmdline, "", "py-spy not found")


def test_dying_marker_lines_are_parsed_and_anything_else_is_not() -> None:
    marker = progress.DYING_MARKER
    assert progress.dying_pid(f"{marker}RuntimeError (pid 42)") == ("RuntimeError", 42)
    assert progress.dying_pid(f"[rank3]: {marker}torch.OutOfMemoryError (pid 7)") == (
        "torch.OutOfMemoryError", 7
    )  # fmt: skip
    for line in (f"{marker}RuntimeError", f"{marker} (pid 42)", f"{marker}X (pid 4x)", "x"):
        assert progress.dying_pid(line) is None
