"""Hang detection: no progress (or, for scripts that never report progress, no output) for too long.

The agent side of :mod:`aegis.training`: :class:`ProgressFile` creates and reads the shared
file; :func:`watch` declares a hang once per idle spell, collects stack dumps and reports. It never
kills anything (seed 7.3: mark first, decide later).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import mmap
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import psutil

from aegis import training as progress
from aegis.agent import hang_policy, ports
from aegis.spawn import owners

log = logging.getLogger(__name__)


PROGRESS_PREFIX = "aegis-progress-"
# "<prefix><pid ns>-<pid>-t<start ticks since boot>-"; older versions: "...-<start ms>-"
_OWNED = re.compile(re.escape(PROGRESS_PREFIX) + r"(\d+)-(\d+)-(t?)(\d+)-")


class Owner(NamedTuple):
    """The agent a progress file's name says made it."""

    ns: int  # its pid namespace
    pid: int
    start: int  # in clock ticks since boot; an older version's name: ms since the epoch
    ticks: bool  # start is in ticks


def owner_of(name: str) -> Owner | None:
    """The agent a progress file's name says made it; None for any other name."""
    m = _OWNED.match(name)
    return Owner(int(m[1]), int(m[2]), int(m[4]), bool(m[3])) if m else None


def stale(owner: Owner) -> bool:
    """Whether a progress file of ``owner`` is left over: its agent is gone (no process with
    that pid and start). Only files of this pid namespace are judged (a host's ``/dev/shm``
    shared with pods that have their own pids)."""
    if owner.ticks:
        return owners.gone_here(owner.ns, owner.pid, owner.start)
    return owner.ns == owners.pid_ns() and owners.legacy_gone(owner.pid, owner.start)


def progress_dir() -> str:
    """Where progress files live: ``/dev/shm`` (memory), else the temporary directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def sweep_dead_owners(directory: str) -> list[str]:
    """Remove the progress files whose agent is gone (a SIGKILLed agent cannot remove its own,
    and on a shared host ``/dev/shm`` outlives it); returns their names."""
    removed = []
    for name in os.listdir(directory):
        owner = owner_of(name)
        if owner is None or not stale(owner):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
            removed.append(name)
    return removed


def save_behind(step: int | None, saved: int | None) -> int | None:
    """The step of the script's last own save once training has gone past it (the save, and
    whatever the script does with the file after, such as a rename, is done); else None."""
    return saved if saved is not None and step is not None and step > saved else None


class ProgressFile:
    """The shared file training processes write ``aegis.progress()`` into, named after this
    agent (pid namespace, pid and start in ticks since boot): if this one is killed, the next
    agent on the host removes it."""

    def __init__(self) -> None:
        directory = progress_dir()
        if removed := sweep_dead_owners(directory):
            log.info("removed %d progress file(s) of agents gone: %s", len(removed),
                     ", ".join(sorted(removed)))  # fmt: skip
        pid = os.getpid()
        prefix = f"{PROGRESS_PREFIX}{owners.pid_ns()}-{pid}-t{owners.start_ticks(pid)}-"
        fd, self.path = tempfile.mkstemp(prefix=prefix, dir=directory)
        try:
            os.ftruncate(fd, progress.SIZE)
            self._map = mmap.mmap(fd, progress.SIZE)
        finally:
            os.close(fd)

    def reset(self) -> None:
        """A new incarnation: no progress, no checkpoint request, not opted in."""
        self._map[:] = bytes(progress.SIZE)

    def request_checkpoint(self, request_id: int, target_step: int, hold_until: float) -> None:
        """Ask the training to save at ``target_step`` (or at once, if past it) and to hold
        until ``hold_until`` (``time.monotonic()``) afterwards; ids only grow."""
        progress.REQUEST_ONLY.pack_into(
            self._map, progress.REQUEST_AT, request_id, target_step, hold_until
        )

    def answered(self) -> int:
        """The id of the last request the training saved for (0: none)."""
        return int(progress.ANSWERED.unpack_from(self._map, progress.ANSWERED_AT)[0])

    def holding_until(self) -> float:
        """Until when the training holds after saving for the last request (0.0: it does not:
        no request, or not answered yet)."""
        request, _, hold_until = progress.REQUEST_ONLY.unpack_from(self._map, progress.REQUEST_AT)
        return float(hold_until) if request and self.answered() == request else 0.0

    def opted_in(self) -> bool:
        """Whether the training takes checkpoint requests (``save_if_requested`` was called)."""
        return bool(progress.OPTED_IN.unpack_from(self._map, progress.OPTED_IN_AT)[0])

    def read(self) -> tuple[int, float] | None:
        """(step, monotonic time) of the last report, None when there was none since reset."""
        step, ts = progress.LAYOUT.unpack_from(self._map, 0)
        return None if ts == 0.0 else (int(step), float(ts))

    def input_s(self) -> float | None:
        """The training's last input time (seconds from a step's end to the next forward,
        :mod:`aegis.autoprogress`), None when it measured none since reset."""
        (seconds,) = progress.INPUT.unpack_from(self._map, progress.INPUT_AT)
        return float(seconds) if seconds > 0.0 else None

    def saved(self) -> int | None:
        """The step of the script's last own save (``torch.save``, a distributed checkpoint:
        :mod:`aegis.autoprogress`), None when it made none since reset."""
        step, saves = progress.SAVED.unpack_from(self._map, progress.SAVED_AT)
        return int(step) if saves > 0 else None

    def close(self) -> None:
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclasses.dataclass(frozen=True, slots=True)
class WatchSettings:
    policy: hang_policy.HangPolicy
    restart_count: int
    started: float  # time.monotonic() of the incarnation's start


Activity = Callable[[], float]  # monotonic time of the last output (or of the start)
Collect = Callable[[], Awaitable[tuple[ports.StackDump, ...]]]
Report = Callable[[ports.HangReport], Awaitable[None]]
SetHung = Callable[[bool], None]
Members = Callable[[], list[psutil.Process]]

CPU_BUSY_S = 0.05  # CPU seconds per second of the process tree that count as working
CUDA_EVERY_S = 10.0


class TreeActivity:
    """The process tree's CPU use (the last time it was busy) and whether CUDA is loaded in
    it, sampled at most once a second (``/proc``, psutil)."""

    def __init__(self, members: Members, started: float) -> None:
        self.members, self.last_busy, self.cuda = members, started, False
        self._cpu: dict[int, float] = {}
        self._sampled = self._cuda_checked = -math.inf

    def sample(self, now: float) -> None:
        if now - self._sampled < 1.0:
            return
        elapsed, self._sampled = now - self._sampled, now
        used, seen = 0.0, {}
        procs = self.members()
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            seen[proc.pid] = total = times.user + times.system
            used += max(0.0, total - self._cpu.get(proc.pid, total))
        self._cpu = seen
        if math.isfinite(elapsed) and used >= CPU_BUSY_S * min(elapsed, 5.0):
            self.last_busy = now
        if now - self._cuda_checked >= CUDA_EVERY_S:
            self._cuda_checked = now
            self.cuda = any(_has_cuda(proc.pid) for proc in procs)


def _has_cuda(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return any(b"libcuda.so" in line for line in maps)
    except OSError:
        return False


class Calibration:
    """The incarnation's reading of the progress file: its steps go into the run's history."""

    def __init__(self, history: hang_policy.StepHistory, started: float) -> None:
        self.history, self.started = history, started
        self.previous: tuple[int, float] | None = None

    def update(self, seen: tuple[int, float] | None) -> float | None:
        """The last step's time (None: none in this incarnation yet)."""
        if seen is None:
            return None
        if seen != self.previous:
            hang_policy.record_step(self.history, self.started, self.previous, seen)
            self.previous = seen
        return seen[1]


async def watch(  # noqa: PLR0913 (the watch loop's inputs and its four hooks)
    settings: WatchSettings,
    history: hang_policy.StepHistory,
    progress_file: ProgressFile,
    last_output: Activity,
    activity: TreeActivity,
    collect: Collect,
    report: Report,
    set_hung: SetHung,
    on_timeout: Callable[[float, str], None] = lambda timeout_s, why: None,
) -> None:
    """Run until cancelled; report each stall the policy calls a hang once. ``on_timeout``
    hears each new choice of timeout (logged, and sent with heartbeats)."""
    interval = 0.1 if settings.policy.fixed_s is None else min(0.1, settings.policy.fixed_s / 10)
    calibration = Calibration(history, settings.started)
    hung, said = False, ("", 0.0)
    while True:
        await asyncio.sleep(interval)
        seen = progress_file.read()
        last_step_ts = calibration.update(seen)
        now = time.monotonic()
        activity.sample(now)
        look = hang_policy.Idle(now, settings.started, last_step_ts, last_output(),
                                activity.last_busy, activity.cuda,
                                progress_file.holding_until())  # fmt: skip
        verdict = hang_policy.judge(settings.policy, history, look)
        if _changed(said, verdict):
            said = (verdict.rule, verdict.timeout_s)
            log.info("hang watchdog: a stall of %.0f s is a hang (%s)",
                     verdict.timeout_s, verdict.why)  # fmt: skip
            on_timeout(verdict.timeout_s, verdict.why)
        if not verdict.hung:
            if hung:
                log.warning("progress again after a hang")
                hung = False
                set_hung(False)
            continue
        if hung:
            continue
        hung = True
        set_hung(True)
        log.warning("no progress for %.1f s (timeout %.0f s: %s): collecting stack dumps",
                    verdict.idle_s, verdict.timeout_s, verdict.why)  # fmt: skip
        stacks = await collect()
        await report(
            ports.HangReport(
                restart_count=settings.restart_count,
                timeout_s=verdict.timeout_s,
                idle_s=verdict.idle_s,
                last_step=None if seen is None else seen[0],
                last_activity_ts=now - verdict.idle_s,
                detected_ts=now,
                stacks=stacks,
                why=verdict.why,
                no_step_signal=verdict.rule == "quiet",
            )
        )


def _changed(said: tuple[str, float], verdict: hang_policy.Verdict) -> bool:
    """A new choice worth a log line: the first, another rule, or a timeout 25% away."""
    rule, before = said
    return rule != verdict.rule or abs(verdict.timeout_s - before) > 0.25 * max(before, 1.0)
