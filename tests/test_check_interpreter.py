"""The node checks run in the job's interpreter, not the agent's.

The agent and the job may live in different Python environments (the agent in a virtualenv of
its own, the job in conda). The runtime check imports torch and reports the Python and torch it
found; it ran in the agent's interpreter, so a job whose agent's environment has no torch failed
its bootcheck on every node: every node was blacklisted and the job ended "no healthy node
left" (found by hand: ``aegis run`` from such an environment). Now the checks run in the
interpreter the command trains in (``pycmd.job_interpreter``: ``python ...``, the ``#!`` line of
``torchrun`` or any script run by name, or ``AEGIS_CHECK_PYTHON``), when it can import them
(``check_host.runs_checks``), else in the agent's, said in one line."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from aegis import autoprogress
from aegis.agent import pycmd
from aegis.checks import host as check_host
from tests import venvs
from tests.cluster import PLAIN_DDP, leftovers, run_cluster


def _script(path: Path, first_line: str) -> str:
    path.write_text(f"{first_line}\nprint('hello')\n")
    path.chmod(0o755)
    return str(path)


def test_the_interpreter_a_command_trains_in(tmp_path: Path) -> None:
    python = shutil.which("python3")
    assert python is not None
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.path.dirname(python)}"}
    absolute = _script(tmp_path / "torchrun", "#!/opt/conda/bin/python3.11")
    through_env = _script(tmp_path / "train.py", "#!/usr/bin/env python3")
    split = _script(tmp_path / "split", "#!/usr/bin/env -S PYTHONUNBUFFERED=1 python3 -u")
    shell = _script(tmp_path / "run.sh", "#!/bin/bash")
    _script(tmp_path / "not-python", "#!/usr/bin/env python3-config")
    (tmp_path / "binary").write_bytes(b"\x7fELF\x02\x01\x01")
    (tmp_path / "binary").chmod(0o755)
    cases = {
        ("python3", "train.py"): python,
        (python, "-m", "torch.distributed.run"): python,
        ("torchrun", "--nproc-per-node", "2", "train.py"): "/opt/conda/bin/python3.11",
        (absolute,): "/opt/conda/bin/python3.11",
        ("train.py", "--steps", "3"): python,  # run by name, #!/usr/bin/env python3
        (through_env,): python,
        (split,): python,
        ("run.sh",): None,  # a shell: the command does not say
        (shell,): None,
        ("bash", "-c", "python3 train.py"): None,
        ("not-python",): None,
        ("binary",): None,
        ("no-such-program",): None,
        (): None,
    }
    assert {argv: pycmd.job_interpreter(argv, env) for argv in cases} == cases
    named = {**env, pycmd.CHECK_PYTHON_VAR: "python3"}  # said outright: it wins
    assert pycmd.job_interpreter(["bash", "-c", "x"], named) == python
    named[pycmd.CHECK_PYTHON_VAR] = "/opt/py/bin/python"  # not here: kept as said
    assert pycmd.job_interpreter(["torchrun"], named) == "/opt/py/bin/python"


async def test_an_interpreter_runs_the_checks_when_it_can_import_them(tmp_path: Path) -> None:
    assert await check_host.runs_checks(sys.executable, os.environ) is None
    # no aegis of its own: it reaches the agent's (and its torch is its own business)
    bare = venvs.venv(tmp_path / "bare")
    assert await check_host.runs_checks(bare, venvs.without_pythonpath()) is None
    false = shutil.which("false")
    assert false is not None
    why = await check_host.runs_checks(false, os.environ)
    assert why == f"{false} cannot import the checks: exit 1"
    why = await check_host.runs_checks(str(tmp_path / "nope"), os.environ)
    assert why is not None and why.startswith(f"{tmp_path / 'nope'} does not start")
    too_old = "#!/bin/sh\necho 'SyntaxError: invalid syntax' >&2\nexit 1"
    broken = _script(tmp_path / "python3", too_old)
    assert await check_host.runs_checks(broken, os.environ) == (
        f"{broken} cannot import the checks: SyntaxError: invalid syntax"
    )
    # an aegis of its own, another version: its checks may not take this agent's arguments
    own = tmp_path / "own-aegis"
    (own / "aegis" / "checks").mkdir(parents=True)
    (own / "aegis" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (own / "aegis" / "checks" / "__init__.py").write_text("")
    (own / "aegis" / "checks" / "collective.py").write_text("")
    other = venvs.venv(tmp_path / "other", [str(own)])
    assert await check_host.runs_checks(other, venvs.without_pythonpath()) == (
        f"{other} has aegis 0.0.1 of its own ({own / 'aegis'}), not this agent's"
    )


def test_only_another_interpreter_gets_the_agents_aegis_on_its_path(tmp_path: Path) -> None:
    env = {"PYTHONPATH": f"/theirs{os.pathsep}{autoprogress.SITE_DIR}", "PATH": "/bin"}
    ours = check_host.check_env(env, sys.executable)
    assert ours == {**env, "PYTHONUNBUFFERED": "1"}
    theirs = check_host.check_env(env, str(tmp_path / "python"))
    assert theirs["PYTHONPATH"] == f"{autoprogress.SITE_DIR}{os.pathsep}/theirs"


@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_a_job_in_its_own_environment_passes_its_checks_where_the_agents_has_no_torch(
    tmp_path: Path,
) -> None:
    agent_python = venvs.agent_venv(tmp_path / "agent-env")  # aegis, no torch
    job_python = venvs.venv(tmp_path / "job-env", [venvs.SITE])  # torch, no aegis
    command = [job_python, str(PLAIN_DDP), "--steps", "30", "--step-time-s", "0.05",
               "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "env", "--max-retry", "1"]
    run = await run_cluster(tmp_path, flags, command, aegis=[agent_python, "-m", "aegis"],
                            timeout_s=400)  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert status["error_nodes"] == [], status
    assert "torch is not in this environment" not in run.output
    assert leftovers(run.log_dir) == []
