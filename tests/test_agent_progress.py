"""aegis.progress(): a no-op without an agent, one write into the shared file under one."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aegis
from aegis import training as progress
from aegis.agent import ports, reaper, stacks, watchdog


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
