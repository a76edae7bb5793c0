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


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``'s field 22:
    unlike a wall-clock start time it never moves within a boot, whatever the clock does);
    None where it cannot be read (no such process, or hidden: ``hidepid``)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts, even where /proc hides
    it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_name(pid: int | None = None) -> str:
    """Process ``pid`` (this one) named for any host: ``boot=<boot id> ns=<pid ns> pid=<pid>
    ticks=<start in ticks since boot>``."""
    pid = os.getpid() if pid is None else pid
    return f"boot={boot_id()} ns={pid_ns()} pid={pid} ticks={start_ticks(pid)}"


def process_gone(
    name: str,
    exists_now: Callable[[int], bool] = exists,
    ticks_of: Callable[[int], int | None] = start_ticks,
) -> bool:
    """Whether the process :func:`process_name` named is known to be gone: one of this host's
    boot and pid namespace, and no process has its pid, or the one that has it started at
    another time, or it has ended and waits for its parent to collect it (a zombie). One of
    another host, boot or pid namespace, one whose start cannot be read (another user's,
    where /proc hides it), or a name of another form: not known gone."""
    try:
        fields = dict(field.split("=", 1) for field in name.split())
        boot, ns_ino = fields["boot"], int(fields["ns"])
        pid, ticks = int(fields["pid"]), int(fields["ticks"])
    except (ValueError, KeyError):
        return False
    if not boot or boot != boot_id() or ns_ino != pid_ns() or pid <= 0:
        return False
    if not exists_now(pid):
        return True
    now = ticks_of(pid)
    return (now is not None and now != ticks) or zombie(pid)


def zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended and only waits for its parent to collect it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
