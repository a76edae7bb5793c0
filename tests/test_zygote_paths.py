"""Warm starts and what ``python`` finds where: a script that is not a source file, and
``sys.path`` under ``-P``/``-I``; a warm child does what a cold ``python`` does."""

from __future__ import annotations

import os
import sys
import zipapp
from pathlib import Path

import pytest

from aegis.agent import pycmd, reaper
from tests import forkserver_harness as harness
from tests.waits import async_wait_until

the_reaper, devnull = harness.the_reaper, harness.devnull  # fixtures

PYTHON = sys.executable
_APP = 'import json, sys\nprint("PROBE", json.dumps({"argv": sys.argv}), flush=True)\nsys.exit(3)\n'


@pytest.mark.parametrize(
    ("argv", "is_source", "warm"),
    [
        ([PYTHON, "train.py", "--lr", "1"], True, True),
        ([PYTHON, "app.pyz"], False, False),
        ([PYTHON, "-u", "-m", "pkg.train"], False, True),  # -m: no script to look at
        (["bash", "-c", "python train.py"], True, False),
    ],
)
def test_warm_command_is_only_a_source_script_or_module_when_asked(
    argv: list[str], is_source: bool, warm: bool
) -> None:
    looked: list[str] = []

    def source(path: str) -> bool:
        looked.append(path)
        return is_source

    command = pycmd.warm_command(argv, os.environ, source)
    assert (command is not None) == warm
    assert command is None or command == pycmd.parse(argv, os.environ)
    assert looked == (["train.py"] if argv[0] == PYTHON and argv[1].endswith(".py") else
                      ["app.pyz"] if argv[1] == "app.pyz" else [])  # fmt: skip


def test_plain_source_is_a_regular_file_that_is_no_zip_when_checked(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text(_APP)
    zipapp.create_archive(tmp_path / "app", tmp_path / "app.pyz")
    (tmp_path / "train.py").write_text(_APP)
    assert pycmd.is_plain_source(str(tmp_path / "train.py"))
    assert not pycmd.is_plain_source(str(tmp_path / "app.pyz"))
    assert not pycmd.is_plain_source(str(tmp_path / "app"))
    assert not pycmd.is_plain_source(str(tmp_path / "missing.py"))


@pytest.mark.parametrize("shape", ["zipapp", "directory", "missing"])
async def test_warm_start_runs_what_cold_python_runs_when_script_is_no_source_file(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path, shape: str
) -> None:
    """``python app.pyz`` (a zipapp, PEX, shiv build), ``python some_dir/`` (with a
    ``__main__.py``) and a missing script (CPython: "can't open file", exit 2) end as cold."""
    target = tmp_path / "app"
    if shape != "missing":
        target.mkdir()
        (target / "__main__.py").write_text(_APP)
    if shape == "zipapp":
        zipapp.create_archive(target, tmp_path / "app.pyz")
        target = tmp_path / "app.pyz"
    reports, seen = await harness.cold_then_warm([PYTHON, str(target)], the_reaper, devnull)
    status = 2 if shape == "missing" else 3
    assert [r.exit_status for r in reports] == [status] * 3
    assert seen == ([] if shape == "missing" else [{"argv": [str(target)]}] * 3)


_PATHS = """import json, sys
found = {}
for name in ("on_pythonpath", "beside_script"):
    try:
        __import__(name)
        found[name] = True
    except ImportError:
        found[name] = False
print("PROBE", json.dumps({"found": found, "path": sys.path}), flush=True)
"""


@pytest.mark.parametrize("flag", ["-P", "-I", None])
async def test_warm_child_has_cold_sys_path_when_safe_path_flag_is_given(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path, flag: str | None
) -> None:
    """``-P`` keeps the script's directory off ``sys.path`` and ``-I`` PYTHONPATH too; the
    zygote took the first PYTHONPATH entry off and put the script's directory first."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "on_pythonpath.py").write_text("")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "beside_script.py").write_text("")
    (tmp_path / "job" / "probe.py").write_text(_PATHS)
    env = harness.with_path(str(tmp_path / "lib"))
    argv = [PYTHON, *([flag] if flag else []), str(tmp_path / "job" / "probe.py")]
    reports, (cold, *warms) = await harness.cold_then_warm(argv, the_reaper, devnull, env=env)
    assert [r.exit_status for r in reports] == [0] * 3 and len(warms) == 2
    assert cold["found"] == {"on_pythonpath": flag != "-I", "beside_script": flag is None}
    assert all(warm == cold for warm in warms), (cold, warms)


async def test_the_jobs_own_library_beside_its_scripts_is_imported_fresh_by_each_warm_start(
    the_reaper: reaper.Reaper, devnull: int, tmp_path: Path
) -> None:
    """``repo/scripts/train.py`` importing ``repo/src/mylib`` (PYTHONPATH=src, as an editable
    install has it): the zygote imported mylib as if it were a library, so a warm restart ran
    the code as it was before a fix, with what it read from the environment at import."""
    lib = tmp_path / "src" / "mylib"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("VERSION = 'buggy'\n")
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "train.py"
    probe = "print('PROBE', json.dumps([mylib.VERSION, os.getppid()]), flush=True)\n"
    script.write_text("import json, os, mylib\n" + probe)
    env = harness.with_path(str(tmp_path / "src"))
    sup, _, lines = harness.make([PYTHON, str(script)], the_reaper, devnull, env=env)
    async with sup:
        await sup.start()
        assert (await sup.wait()).exit_status == 0
        zygotes = sup.zygotes
        assert zygotes is not None
        await async_wait_until(lambda: zygotes.made == 2, 60, "the next zygote made")
        await zygotes.ready()  # it has imported what it prewarms: the library is fixed after
        (lib / "__init__.py").write_text("VERSION = 'fixed'\n")
        await sup.restart()
        assert (await sup.wait()).exit_status == 0
    (_, first), (version, parent) = lines.json("PROBE")
    assert first != os.getpid() and parent != os.getpid()  # both forked from zygotes: warm
    assert version == "fixed"
