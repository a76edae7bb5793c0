"""A process named by its host's boot, pid namespace, pid and start, as what one leaves behind
names its owner (a progress file in ``/dev/shm``, a pod's checkpoint memory there, an embedded
NATS server's directory in /tmp, a job's record in the status store): a pid alone may be reused
by another process once its owner is gone; with its start it is not.

The start is counted in clock ticks since boot (``/proc/PID/stat``), never by the wall clock:
a start time in seconds since the epoch is the boot time plus those ticks, and the kernel moves
the boot time whenever the clock is set (an NTP step, and slowly with every slew), so a live
owner read again after that looked like another process, and what it held looked left over.
Only owners of this boot and pid namespace are judged gone (a host's ``/dev/shm`` shared with
containers that have their own pids). Names older versions wrote (a start in ms since the epoch)
are still read, and judged as they were."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psutil

OWNER = "OWNER"  # the file in a directory that names its owner (:func:`process_name`)
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # a new one each boot, and on each host


def pid_ns() -> int:
    """This process's pid namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def boot_id() -> str:
    """This host's boot ("" where /proc does not say)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command's name (its state first); None where
    it cannot be read (no such process, or hidden: ``hidepid``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def seen(pid: int) -> tuple[int, bool] | None:
    """Process ``pid``'s start in clock ticks since boot (``/proc/PID/stat``'s field 22: unlike
    a wall-clock start time it never moves within a boot, whatever the clock does) and whether
    it has ended and only waits for its parent to collect it (a zombie), from one read; None
    where it cannot be read."""
    fields = _stat(pid)
    try:
        return (int(fields[19]), fields[0] == "Z") if fields is not None else None
    except (ValueError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (:func:`seen`)."""
    now = seen(pid)
    return now[0] if now is not None else None


def zombie(pid: int) -> bool:
    """Whether process ``pid`` has ended and only waits for its parent to collect it."""
    now = seen(pid)
    return now is not None and now[1]


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


def gone_here(
    ns: int,
    pid: int,
    ticks: int,
    exists_now: Callable[[int], bool] = exists,
    seen_of: Callable[[int], tuple[int, bool] | None] = seen,
) -> bool:
    """Whether the process of this boot that had ``pid`` in pid namespace ``ns`` and started
    at ``ticks`` is known to be gone: it is of this pid namespace, and no process has its pid,
    or the one that has it started at another time, or it has ended and waits for its parent
    to collect it (a zombie; both from one read, :func:`seen`). One whose start cannot be read
    (another user's, where /proc hides it): not known gone."""
    if ns != pid_ns() or pid <= 0:
        return False
    if not exists_now(pid):
        return True
    now = seen_of(pid)
    return now is not None and (now[0] != ticks or now[1])


def _named(name: str) -> tuple[str, int, int, int] | None:
    """The (boot, pid namespace, pid, start ticks) of a :func:`process_name`; None for a text
    of another form."""
    try:
        fields = dict(field.split("=", 1) for field in name.split())
        return fields["boot"], int(fields["ns"]), int(fields["pid"]), int(fields["ticks"])
    except (ValueError, KeyError):
        return None


def elsewhere(name: str) -> bool:
    """Whether the process ``name`` (:func:`process_name`) names is one this host cannot judge:
    of another boot (another host, or this one before it restarted) or of another pid namespace
    (another container). A name of another form: not known to be."""
    named = _named(name)
    return named is not None and (named[0] != boot_id() or named[1] != pid_ns())


def process_gone(
    name: str,
    exists_now: Callable[[int], bool] = exists,
    seen_of: Callable[[int], tuple[int, bool] | None] = seen,
    *,
    local: bool = False,
) -> bool:
    """Whether the process :func:`process_name` named is known to be gone (:func:`gone_here`).
    One of another boot is, when the name was found in this host's own files (``local``: the
    host restarted since); else it may be another host's, and is not. One of another pid
    namespace, where this host's boot is not known, or a name of another form: not known
    gone."""
    named, here = _named(name), boot_id()
    if named is None or not named[0] or not here:
        return False
    boot, ns, pid, ticks = named
    if boot != here:
        return local
    return gone_here(ns, pid, ticks, exists_now, seen_of)


def claim(directory: Path, pid: int | None = None) -> None:
    """Make ``directory`` (if need be) and name process ``pid`` (this one) its owner."""
    pid = os.getpid() if pid is None else pid
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{OWNER}.{os.getpid()}"
    tmp.write_text(process_name(pid) + "\n")
    os.replace(tmp, directory / OWNER)


def held(directory: Path) -> bool:
    """Whether ``directory``'s owner file (:func:`claim`) names a live process of this boot and
    pid namespace (one whose start cannot be read counts as live). One with no owner file, an
    owner gone, of another pid namespace (whose pids cannot be judged here) or a file that
    does not parse: not held."""
    try:
        text = (directory / OWNER).read_text()
    except OSError:
        return False
    named = _named(text)
    if named is not None:
        return named[1] == pid_ns() and named[2] > 0 and not process_gone(text, local=True)
    try:  # an older version's: "<pid ns> <pid> <start ms>"
        ns, pid, started = (int(field) for field in text.split())
    except ValueError:
        return False
    return ns == pid_ns() and not legacy_gone(pid, started)


def started_ms(pid: int) -> int | None:
    """When process ``pid`` started, in ms since the epoch (None: no such process): how older
    versions named owners; it moves whenever the clock is set (see the module's note)."""
    try:
        return int(psutil.Process(pid).create_time() * 1000)
    except psutil.Error:
        return None


def legacy_gone(
    pid: int, started: int, started_of: Callable[[int], int | None] = started_ms
) -> bool:
    """Whether the process an older version named by ``pid`` and its start in ms since the
    epoch is gone (its name found in what that version left)."""
    return started_of(pid) != started
