"""A process named by its pid namespace, pid and start time, as what one leaves behind names its
owner (a progress file in ``/dev/shm``, a pod's checkpoint memory there, an embedded NATS
server's directory in /tmp): a pid alone may be reused by another process once its owner is
gone; with the start time it is not. Only owners of this pid namespace are judged (a host's
``/dev/shm`` shared with containers that have their own pids)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psutil

OWNER = "OWNER"  # the file in a directory that names its owner: "<pid ns> <pid> <start ms>\n"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # a new one each boot, and on each host


def started_ms(pid: int) -> int | None:
    """When process ``pid`` started, in ms since the epoch (None: no such process)."""
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except psutil.Error:
        return None


def pid_ns() -> int:
    """This process's pid namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def gone(pid: int, started: int, started_of: Callable[[int], int | None] = started_ms) -> bool:
    """Whether the process that had ``pid`` and started at ``started`` (ms) is gone."""
    return started_of(pid) != started


def claim(directory: Path, pid: int | None = None) -> None:
    """Make ``directory`` (if need be) and name process ``pid`` (this one) its owner."""
    pid = os.getpid() if pid is None else pid
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{OWNER}.{os.getpid()}"
    tmp.write_text(f"{pid_ns()} {pid} {started_ms(pid)}\n")
    os.replace(tmp, directory / OWNER)


def held(directory: Path, started_of: Callable[[int], int | None] = started_ms) -> bool:
    """Whether ``directory``'s owner file (:func:`claim`) names a live process of this pid
    namespace. One with no owner file, an owner gone, of another pid namespace (whose pids
    cannot be judged here) or a file that does not parse: not held."""
    try:
        ns, pid, started = (int(field) for field in (directory / OWNER).read_text().split())
    except (OSError, ValueError):
        return False
    return ns == pid_ns() and not gone(pid, started, started_of)


def boot_id() -> str:
    """This host's boot ("" where /proc does not say)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def process_name(pid: int | None = None) -> str:
    """Process ``pid`` (this one) named for any host: ``<boot id> <pid ns> <pid> <start ms>``."""
    pid = os.getpid() if pid is None else pid
    return f"{boot_id()} {pid_ns()} {pid} {started_ms(pid)}"


def process_gone(name: str, started_of: Callable[[int], int | None] = started_ms) -> bool:
    """Whether the process :func:`process_name` named is known to be gone: one of this host's
    boot and pid namespace that no longer runs. One of another host, boot or pid namespace (it
    cannot be judged here), or a name that does not parse: not known gone."""
    try:
        boot, ns, pid, started = name.split()
        judged = bool(boot) and boot == boot_id() and int(ns) == pid_ns()
        return judged and gone(int(pid), int(started), started_of)
    except ValueError:
        return False
