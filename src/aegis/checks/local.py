"""The node-local checks without hardware ports: io and hang (runtime needs torch: it runs in the
round's check child, :mod:`aegis.checks.group`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from aegis.checks.base import CheckSettings, Outcome

_ERRNO_WORDS = {
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EIO: "I/O error",
}


async def io_check(settings: CheckSettings) -> Outcome:
    if settings.ckpt_dir is not None:
        failed = await asyncio.to_thread(_probe_ckpt, settings.ckpt_dir)
        if failed is not None:
            return failed
    return await asyncio.to_thread(
        _io, settings.scratch_dir, settings.io_size_mb, settings.io_floor_mb_s
    )


CKPT_PROBE_BYTES = 64 * 1024


def _probe_ckpt(directory: Path) -> Outcome | None:
    """A failure naming the durable checkpoint directory when a small file cannot be written
    and fsync'd there (full, read-only, vanished); None when it can. Made when missing, as the
    saver daemon makes it (a round may come before the daemon's first start)."""
    path = directory / f".aegis-io-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as out:
            out.write(os.urandom(CKPT_PROBE_BYTES))
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        code = exc.errno or 0
        word = _ERRNO_WORDS.get(code, exc.strerror or str(exc))
        return Outcome(False, f"checkpoint directory {directory}: {word} "
                              f"([Errno {code}] {errno.errorcode.get(code, '?')})")  # fmt: skip
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    return None


def _io(
    directory: Path,
    size_mb: int,
    floor_mb_s: float,
    read_back: Callable[[Path], BinaryIO] = lambda path: path.open("rb"),
) -> Outcome:
    """``read_back`` opens the written file for the comparison (a test's corrupting reader
    stands in for a device that returns other bytes than it was given)."""
    path = directory / f".aegis-io-check-{os.getpid()}"
    block = os.urandom(1024 * 1024)
    started = time.monotonic()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as out:
            for _ in range(size_mb):
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
            # Drop the clean pages so the read below comes from the device, not the page cache.
            os.posix_fadvise(out.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with read_back(path) as back:
            for number in range(size_mb):
                if back.read(len(block)) != block:
                    return Outcome(False, f"read back differs at MB {number} in {directory}")
    except OSError as exc:
        word = _ERRNO_WORDS.get(exc.errno or 0, exc.strerror or str(exc))
        return Outcome(False, f"{word} ({errno.errorcode.get(exc.errno or 0, '?')}) on {directory}")
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    elapsed = max(time.monotonic() - started, 1e-6)
    rate = 2 * size_mb / elapsed
    if rate < floor_mb_s:
        return Outcome(False, f"{rate:.1f} MB/s below the floor of {floor_mb_s:g} MB/s")
    return Outcome(True, f"{rate:.0f} MB/s write+fsync+read of {size_mb} MB in {directory}")


async def hang_check(settings: CheckSettings) -> Outcome:
    if settings.hung:
        return Outcome(False, "no progress within the hang timeout")
    return Outcome(True, "making progress")
