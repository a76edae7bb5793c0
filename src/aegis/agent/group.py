"""Process-group and descendant helpers: signal, test for life, terminate with a deadline.

Nothing here waits for a process: the reaper collects the exits, these helpers only look.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Container

import psutil

log = logging.getLogger(__name__)

POLL_S = 0.005


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("not allowed to signal process group %s", pgid)
        return False
    return True


def give_terminal(pgid: int) -> None:
    """Make ``pgid`` the foreground group of our controlling terminal, if stdin is one (tini -g).

    Without this a command that reads its terminal (``docker run -it``) would be stopped by
    SIGTTIN, its group not being in the foreground.
    """
    if not os.isatty(0):
        return
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we may be in the background now
    try:
        os.tcsetpgrp(0, pgid)
    except OSError as exc:
        log.debug("cannot give the terminal to group %s: %s", pgid, exc)
    finally:
        signal.signal(signal.SIGTTOU, previous)


def member_pids(pgid: int) -> list[int]:
    """Pids of the group's live members (zombies left out), read from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:
            continue
        # fields after the command name: state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            found.append(int(name))
    return found


def group_alive(pgid: int) -> bool:
    """Whether the group has a live member; zombies someone else must reap do not count."""
    return signal_group(pgid, 0) and bool(member_pids(pgid))


def members(pgid: int) -> list[psutil.Process]:
    """Live processes of the group."""
    found = []
    for pid in member_pids(pgid):
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


async def wait_group_gone(pgid: int, deadline: float) -> bool:
    """Poll until the group is empty or the loop time passes ``deadline``."""
    return await _until(lambda: not group_alive(pgid), deadline)


async def _until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done`` until it holds (True) or the loop time passes ``deadline`` (False)."""
    loop = asyncio.get_running_loop()
    while not done():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(POLL_S)
    return True


async def terminate_group(pgid: int, grace_s: float) -> None:
    """SIGTERM (and SIGCONT, for stopped members) the group, then SIGKILL it after ``grace_s``.
    The leader's descendants in groups of their own (torchrun starts its workers in new
    sessions), which a group's signal misses, are left to the leader to stop within the grace
    period, and SIGKILLed with the group past it (or when they outlive it)."""
    loop = asyncio.get_running_loop()
    escaped = _escaped(pgid)
    if signal_group(pgid, signal.SIGTERM):
        signal_group(pgid, signal.SIGCONT)
    deadline = loop.time() + grace_s
    group_gone = await wait_group_gone(pgid, deadline)
    if group_gone and await _gone(escaped, deadline):
        return
    escaped = _alive([*escaped, *_escaped(pgid)])
    log.warning("process group %s outlived its %.1f s grace period (%d process(es) in groups "
                "of their own): SIGKILL", pgid, grace_s, len(escaped))  # fmt: skip
    signal_group(pgid, signal.SIGKILL)
    _signal_all(escaped, signal.SIGKILL)
    if not await wait_group_gone(pgid, loop.time() + 5.0):
        log.error("process group %s survives SIGKILL", pgid)
    if not await _gone(escaped, loop.time() + 5.0):
        log.error("descendants of group %s survive SIGKILL", pgid)


def _escaped(pgid: int) -> list[psutil.Process]:
    """The group leader's live descendants outside its group. (While the group has members no
    new process takes its id, so ``pgid`` is still that leader, or no process.)"""
    try:
        descendants = psutil.Process(pgid).children(recursive=True)
    except psutil.Error:
        return []
    outside = []
    for process in descendants:
        try:
            if os.getpgid(process.pid) != pgid:
                outside.append(process)
        except OSError:
            continue
    return _alive(outside)


async def _gone(processes: list[psutil.Process], deadline: float) -> bool:
    """Poll until none of ``processes`` lives or the loop time passes ``deadline``."""
    return await _until(lambda: not _alive(processes), deadline)


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            continue
    return alive


def _signal_all(processes: list[psutil.Process], sig: int) -> None:
    for process in processes:
        try:
            process.send_signal(sig)
        except psutil.Error:
            continue


async def terminate_descendants(grace_s: float) -> None:
    """SIGTERM every descendant of this process (orphans included), SIGKILL after ``grace_s``."""
    processes = _alive(psutil.Process().children(recursive=True))
    if processes:
        log.warning("terminating %d leftover process(es)", len(processes))
        await _terminate_all(processes, grace_s)


def adopted(started: Container[int]) -> list[psutil.Process]:
    """The live processes under this process's children that it did not start (``started``: the
    pids it did): orphans re-parented to it as PID 1 or child subreaper, and theirs. A command
    whose processes left its group in sessions of their own (a ``setsid`` daemon, torchrun's
    workers once torchrun died) leaves them here when it ends."""
    found = []
    for child in psutil.Process().children():
        if child.pid in started:
            continue
        try:
            found += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    return _alive(found)


async def terminate_adopted(started: Container[int], grace_s: float) -> None:
    """Stop what :func:`adopted` finds (SIGTERM, SIGKILL after ``grace_s``)."""
    processes = adopted(started)
    if processes:
        log.warning("stopping %d process(es) the command left behind outside its group: %s",
                    len(processes), ", ".join(str(p.pid) for p in processes[:8]))  # fmt: skip
        await _terminate_all(processes, grace_s)


async def _terminate_all(processes: list[psutil.Process], grace_s: float) -> None:
    loop = asyncio.get_running_loop()
    _signal_all(processes, signal.SIGTERM)
    _signal_all(processes, signal.SIGCONT)  # a stopped one would never see the SIGTERM
    for sig, deadline in (
        (signal.SIGKILL, loop.time() + grace_s),
        (None, loop.time() + grace_s + 5.0),
    ):
        while (processes := _alive(processes)) and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if not processes:
            return
        if sig is not None:
            _signal_all(processes, sig)
    log.error("%d process(es) survive SIGKILL", len(processes))
