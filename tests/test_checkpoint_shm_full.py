"""A save bigger than the free shared memory (a pod's /dev/shm is 64 MiB by default) fails with
a clear error, and the training process lives on to save something smaller.

A real 1 MiB tmpfs (mounting one needs root), a real process saving into it: before its
buffer was given its space up front, the first write past the free space killed the process
with SIGBUS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent_waits import BIN

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "shm"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_save_bigger_than_free_shared_memory_raises_shm_full_and_leaves_no_buffer(
    small_shm: Path,
) -> None:
    done = subprocess.run([sys.executable, str(BIN / "shm_full_save.py"), str(small_shm)],
                          check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-4000:]}"
    report = json.loads(done.stdout)
    assert report["saver"] == (
        f"checkpoint not saved: {small_shm / 'pod'} needs 4194304 more bytes for the save's "
        "buffer and has 1048576 bytes free (raise the pod's shared-memory size)"
    )
    assert report["left"] == []  # the buffer file it began to grow is gone
    assert report["after"] == ["buf-0", "slot-1.json", "slot-1.pkl"]
    assert f"ShmFullError: checkpoint not saved: {small_shm / 'dcp-pod'} needs" in report["dcp"]
