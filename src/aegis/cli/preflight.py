"""What ``aegis run`` checks before it starts anything: that the node checks' interpreter has
torch, and that the command's program (or Python script) is on this machine. Each failure is
one line and exit 2, not a fault budget spent on every node."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import typer

from aegis.agent import pycmd
from aegis.checks import host as check_host
from aegis.platforms import run_settings


def exit_without_torch(command: Sequence[str]) -> None:
    """The agents run the checks in the job's Python (``python3 train.py``'s, a script's
    ``#!`` line's) when it can run them, else in this one: without torch there, every node
    would fail its runtime check and join ErrorNodes. Say so in one line before anything
    starts."""
    job = pycmd.job_interpreter(command, os.environ)
    theirs = job if job is not None and not check_host.is_agents(job) else None
    if theirs is not None and asyncio.run(check_host.runs_checks(theirs, os.environ)) is None:
        if _has_torch(theirs) is False:
            print(f"aegis: error: the node checks run in the job's interpreter, {theirs}, which "
                  f"has no torch: install torch there, or name one that has it in "
                  f"{pycmd.CHECK_PYTHON_VAR}", file=sys.stderr)  # fmt: skip
            raise typer.Exit(2)
        return
    if importlib.util.find_spec("torch") is None:
        print(
            f"aegis: error: the checks of aegis run import torch, which {sys.executable} does "
            "not have: pip install 'aegis-ft[torch]' (or the torch build your training uses)",
            file=sys.stderr,
        )
        raise typer.Exit(2)


NO_TORCH = 3  # what the probe exits with when its Python finds no torch
_HAS_TORCH = f"import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') else {NO_TORCH})"


def _has_torch(python: str) -> bool | None:
    """Whether ``python`` finds torch (without importing it); None when it does not say."""
    try:
        found = subprocess.run([python, "-c", _HAS_TORCH], stdin=subprocess.DEVNULL,
                               capture_output=True, timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, NO_TORCH: False}.get(found.returncode)


def exit_unless_found(command: Sequence[str]) -> None:
    """Every pod runs the command on this machine: a program (or a Python script) that is not
    here is one line and exit 2, not a fault budget spent on "exit status 127" (or 2) and a
    check round a restart."""
    word = run_settings.program_of(command)
    if word is None:
        return
    if command[0] == "bash":  # bash -c: bash knows its builtins and keywords too
        asked = subprocess.run(["bash", "-c", 'type -t -- "$1" >/dev/null', "aegis", word],
                               capture_output=True, check=False)  # fmt: skip
        found = asked.returncode == 0
    else:
        found = shutil.which(word) is not None
    if not found:
        print(f"aegis: error: {word}: command not found (the command after --)", file=sys.stderr)
        raise typer.Exit(2)
    script = run_settings.script_of(command, os.environ)
    if script is not None and not os.path.isfile(script):
        print(f"aegis: error: {script}: no such file (the script of the command after --)",
              file=sys.stderr)  # fmt: skip
        raise typer.Exit(2)
