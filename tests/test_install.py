"""A clean install (issue 19): ``pip install .`` in a fresh venv, no dev extras, gives a working
``aegis run`` (a real 2-pod DDP job with checkpoints; before torch is installed, one line that
says the checks need it), and ``aegis operator`` without the ``kubernetes`` extra says in one
line which pip command brings it. The source installed is what
``deploy/Dockerfile`` copies into the image, and the extras the image asks for resolve.

One slow test: a venv, torch (the CPU wheel on disk, as ``make`` installs it), the package and
its dependencies through pip's cache; a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).parent.parent
TRAIN = ROOT / "examples" / "train_ddp.py"
HINT = "aegis: error: the operator needs kopf (not installed): pip install 'aegis-ft[kubernetes]'"
DEV_ONLY = ("kopf", "kubernetes", "pynvml", "pytest", "hypothesis", "grpc_tools", "yaml")


def image_source(into: Path) -> Path:
    """What ``deploy/Dockerfile`` copies to ``/src`` (``COPY a b /src/``, ``COPY d /src/d``)."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copies = re.findall(r"^COPY (?!--from)(.+) (/src\S*)$", dockerfile, flags=re.MULTILINE)
    assert copies, "the Dockerfile copies nothing to /src"
    for sources, target in copies:  # a directory's contents go into the target, as COPY does
        to = into / target.removeprefix("/src").strip("/")
        for name in sources.split():
            if (ROOT / name).is_dir():
                skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
                shutil.copytree(ROOT / name, to, dirs_exist_ok=True, ignore=skip)
            else:
                to.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, to / name)
    return into


def clean_env(venv: Path) -> dict[str, str]:
    """This environment less the dev venv: its bin off PATH, no VIRTUAL_ENV or PYTHONPATH."""
    ours = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != ours]
    env = {
        k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"}
    }
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    return env


def run(
    argv: list[str | Path], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False, cwd=ROOT)  # fmt: skip


def test_fresh_venv_runs_a_2_pod_job_and_operator_names_its_extra(tmp_path: Path) -> None:
    source = image_source(tmp_path / "src")
    venv = tmp_path / "venv"
    env = clean_env(venv)
    made = run([sys.executable, "-m", "venv", venv], env, 120)
    assert made.returncode == 0, made.stderr
    python, pip = venv / "bin" / "python", [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    package = run([*pip, source], env, 300)
    assert package.returncode == 0, package.stderr[-3000:]
    aegis = venv / "bin" / "aegis"
    no_torch = run([aegis, "run", "--nodes", "2", "--", "true"], env, 60)
    assert (no_torch.returncode, no_torch.stdout) == (2, ""), no_torch.stderr
    assert no_torch.stderr.splitlines() == [
        f"aegis: error: the checks of aegis run import torch, which {python} does not have: "
        "pip install 'aegis-ft[torch]' (or the torch build your training uses)"
    ]
    torch = run([*pip, "torch==2.13.0"], env, 400)  # the CPU wheel on disk
    assert torch.returncode == 0, torch.stderr[-3000:]
    probe = f"import importlib.util as u; print([m for m in {DEV_ONLY!r} if u.find_spec(m)])"
    assert run([python, "-c", probe], env, 60).stdout.strip() == "[]"  # no dev extra came along

    status_file = tmp_path / "status.json"
    job = run([
        aegis, "run", "--nodes", "2", "--view", "plain", "--job", "fresh",
        "--log-dir", tmp_path / "logs", "--status-file", status_file, "--",
        python, TRAIN, "--steps", "20", "--ckpt-every", "10", "--ckpt-dir", tmp_path / "ckpt",
    ], env, 300)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    status = json.loads(status_file.read_text())["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0
    assert sorted(status["pod_infos"]) == ["fresh-0", "fresh-1"]
    assert "Traceback" not in job.stderr, job.stderr

    operator = run([aegis, "operator"], env, 60)
    assert (operator.returncode, operator.stdout, operator.stderr.splitlines()) == (2, "", [HINT])

    image = run([*pip, "--dry-run", "--report", "-", f"{source}[kubernetes,gpu]"], env, 300)
    assert image.returncode == 0, image.stderr[-3000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(image.stdout)["install"]}
    assert {"kopf", "kubernetes", "nvidia-ml-py"} <= names, names
