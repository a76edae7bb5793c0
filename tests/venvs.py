"""Python environments other than the test's own, as users have them: the job in one
virtualenv, the agent in another.

``venv(root, paths, blocked)`` makes a virtualenv of this Python with nothing installed; a ``.pth``
adds ``paths`` (this environment's site-packages: its torch, msgspec, nats; the source tree: its
aegis), and each name in ``blocked`` becomes a module of the venv's own that raises ImportError
(it is found before anything a ``.pth`` adds): an agent's environment without torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import aegis
from aegis.adapters import nats_server

SITE = sysconfig.get_path("purelib")  # this environment's packages (aegis is not among them)
SOURCE = str(Path(aegis.__file__).resolve().parents[1])  # where this aegis is imported from


def without_pythonpath() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def venv(root: Path, paths: Sequence[str] = (), blocked: Sequence[str] = ()) -> str:
    """A virtualenv at ``root`` (see the module); its python."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)],  # type: ignore[attr-defined]
                   check=True, timeout=120)  # fmt: skip
    python = str(root / "bin" / "python")
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.run([python, "-c", where], capture_output=True, text=True, check=True,
                          env=without_pythonpath(), timeout=120).stdout.strip()  # fmt: skip
    if paths:
        Path(site, "added.pth").write_text("".join(f"{p}\n" for p in paths))
    for name in blocked:
        Path(site, f"{name}.py").write_text(
            f"raise ImportError('{name} is not in this environment ({root})')\n"
        )
    return python


def agent_venv(root: Path) -> str:
    """An agent's own environment: aegis and its dependencies, no torch; ``nats-server`` beside
    its python, where ``aegis run`` looks for it."""
    python = venv(root, [SITE, SOURCE], blocked=["torch"])
    shutil.copy2(nats_server.find_binary(), root / "bin" / "nats-server")
    return python
