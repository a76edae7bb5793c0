"""Training side of progress reporting: ``aegis.progress(step)``, no network, well under 1 µs.

The agent creates a small file (in ``/dev/shm`` where it exists) and names it in the
environment variable ``AEGIS_PROGRESS_FILE``. The first call maps it; every call writes the
step and ``time.monotonic()`` into it with one ``struct.pack_into``. Without the variable (not
under an agent), or when the file cannot be mapped, a call does nothing. Keep this module free of
heavy imports: it is loaded inside training processes.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

ENV_VAR = "AEGIS_PROGRESS_FILE"
LAYOUT = struct.Struct("<qd")  # step (int64), time.monotonic() of the call (float64)
SIZE = 64


class _Writer:
    """The mapping, opened on first use; ``disabled`` once known to be unavailable."""

    __slots__ = ("buffer", "disabled")

    def __init__(self) -> None:
        self.buffer: mmap.mmap | None = None
        self.disabled = False

    def open(self) -> mmap.mmap | None:
        path = os.environ.get(ENV_VAR)
        try:
            if not path:
                raise FileNotFoundError(ENV_VAR)
            fd = os.open(path, os.O_RDWR)
            try:
                self.buffer = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            self.disabled = True
        return self.buffer


# The one piece of module state: a per-process cache of the mapping (forked children share it).
_writer = _Writer()
_pack_into = LAYOUT.pack_into
_monotonic = time.monotonic


def report(step: int) -> None:
    """Tell the agent that training reached ``step``; a no-op when not under an agent."""
    buffer = _writer.buffer
    if buffer is None:
        if _writer.disabled:
            return
        buffer = _writer.open()
        if buffer is None:
            return
    _pack_into(buffer, 0, step, _monotonic())


def last_step() -> int | None:
    """The step last reported into the file this process's environment names, None if none."""
    buffer = _writer.buffer
    if buffer is None and not _writer.disabled:
        buffer = _writer.open()
    if buffer is None:
        return None
    step, ts = LAYOUT.unpack_from(buffer, 0)
    return None if ts == 0.0 else int(step)
