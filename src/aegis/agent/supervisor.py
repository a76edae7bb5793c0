"""The supervisor of the training command: start, stop, restart in place, wait; evidence as it runs.

Drive it from one event loop (under a master, the order executor does, through the
``ports.Training`` port); it reports facts (exits, a dying process, hangs, fault signatures)
through the ``ports.AgentReports`` port it is given, and knows nothing of who listens::

    async with reaper.Reaper() as the_reaper:
        async with Supervisor(argv, settings, the_reaper, reports) as sup:
            await sup.start()                   # spawn the command in its own process group
            await sup.restart({"MASTER_PORT": "29501"})  # stop the group, start again, count+1
            sup.send_signal(signal.SIGUSR1)     # forward a signal to the group
            report = await sup.wait()           # the next exit that was not a restart
            await sup.stop()                    # SIGTERM the group, grace, SIGKILL

Each incarnation's environment is the supervisor's plus ``AEGIS_RESTART_COUNT`` (first_count, ...),
``AEGIS_PROGRESS_FILE``, the override given to :meth:`start`/:meth:`restart`, and a
``PYTHONPATH`` with :data:`aegis.autoprogress.SITE_DIR` first (unless ``AEGIS_AUTO_PROGRESS=0``):
each of its Python processes reports optimizer steps and an uncaught exception at once, whether
or not the script imports aegis (:mod:`aegis.agent.incarnation`). Its stdout and stderr pass
through line by line and feed a signature scanner; a watchdog reports hangs.

With ``SupervisorSettings.prewarm`` a Python command is forked from a warm interpreter (a zygote,
:mod:`aegis.agent.warm`) instead of spawned: same process group, signals, output, watchdog and
exit status; the zygote's nanny reports the exit instead of the reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from aegis import training as progress
from aegis.agent import (
    group,
    hang_policy,
    incarnation,
    launch,
    ports,
    pump,
    reaper,
    signatures,
    stacks,
    tasks,
    warm,
    watchdog,
)
from aegis.core import errors

log = logging.getLogger(__name__)

RESTART_COUNT_VAR = incarnation.RESTART_COUNT_VAR
REPORT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorSettings:
    grace_s: float = 10.0
    hang_timeout_s: float | None = None  # None: calibrated (hang_policy); 0: off; > 0: fixed
    keep_lines: int = 50
    signatures: tuple[signatures.Signature, ...] = signatures.DEFAULT_SIGNATURES
    stdout_fd: int = 1  # where the command's output goes
    stderr_fd: int = 2
    foreground: bool = False  # hand our terminal (if stdin is one) to the command's group
    prewarm: warm.PrewarmSettings | None = None  # warm (re)starts from a zygote; None: cold
    first_count: int = 0  # the first incarnation's AEGIS_RESTART_COUNT (linked.go_on_counting)


class Supervisor:
    def __init__(
        self,
        argv: Sequence[str],
        settings: SupervisorSettings,
        the_reaper: reaper.Reaper,
        reports: ports.AgentReports,
        *,
        env: Mapping[str, str] | None = None,
        observe: pump.LineObserver | None = None,
    ) -> None:
        if not argv:
            raise ValueError("empty command")
        self._argv = tuple(argv)
        self._settings = settings
        self._reaper = the_reaper
        self._reports = reports
        self._env = dict(os.environ if env is None else env)
        self._observe = observe
        self._current: incarnation.Incarnation | None = None
        self._restart_count = settings.first_count
        self._lock = asyncio.Lock()
        self._tasks = asyncio.TaskGroup()
        self._progress: watchdog.ProgressFile | None = None
        self._flight_request: str | None = None
        self.step_history = hang_policy.StepHistory()  # the run's steps: calibrates the watchdog
        self._hang_timeout = ""  # the watchdog's current choice, and how it was chosen
        self._ever_stepped = False  # some incarnation reported a step
        self._warm: warm.Zygotes | None = None

    async def __aenter__(self) -> Supervisor:
        self._progress = watchdog.ProgressFile()
        await self._tasks.__aenter__()
        if self._settings.prewarm is not None:
            self._warm = warm.Zygotes.create(
                self._argv,
                self._env,
                self._reaper,
                self._settings.prewarm,
                self._settings.stderr_fd,
                self._progress.path + ".modules",
            )
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await self.stop()
        finally:
            if self._warm is not None:
                await self._warm.close()
            await self._tasks.__aexit__(*exc_info)
            if self._progress is not None:
                self._progress.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._progress.path + ".modules")
                stacks.remove_flight_files(self._progress.path + ".fr")

    @property
    def pid(self) -> int | None:
        """The running command's pid (= its process group id), None when none runs."""
        return self._current.pid if self.running and self._current else None

    @property
    def restart_count(self) -> int:
        return self._restart_count

    @property
    def running(self) -> bool:
        return self._current is not None and not self._current.done.done()

    @property
    def hung(self) -> bool:
        """Whether the running command is in a reported hang (no progress past the timeout)."""
        return self.running and self._current is not None and self._current.hung

    @property
    def last_step(self) -> int | None:
        """The step the command last reported with ``aegis.progress()``, None if none yet."""
        return self.progress().step

    def progress(self) -> ports.Progress:
        """A look at the running command's progress file (and the watchdog's choice)."""
        if (file := self._progress) is None:
            return ports.Progress(hang_timeout=self._hang_timeout)
        seen = file.read()
        self._ever_stepped |= seen is not None
        step, step_ts = (None, None) if seen is None else seen
        done = watchdog.save_behind(step, file.saved())
        return ports.Progress(step, step_ts, file.input_s(), self._ever_stepped, file.opted_in(),
                              self._hang_timeout, done, self.hung)  # fmt: skip

    def request_checkpoint(self, request_id: int, target_step: int, hold_s: float) -> None:
        """Ask the running command for a checkpoint at ``target_step`` (``aegis.checkpoint.
        save_if_requested``), held for up to ``hold_s`` after saving."""
        assert self._progress is not None, "use 'async with Supervisor(...)'"
        hold_until = time.monotonic() + hold_s if hold_s > 0 else 0.0
        self._progress.request_checkpoint(request_id, target_step, hold_until)

    @property
    def zygotes(self) -> warm.Zygotes | None:
        """The warm-start pool, None when every start is cold."""
        return self._warm

    @property
    def progress_path(self) -> str:
        assert self._progress is not None, "use 'async with Supervisor(...)'"
        return self._progress.path

    async def start(self, env: Mapping[str, str] | None = None) -> None:
        """Spawn the command; a command that cannot run ends at once (status 127 or 126)."""
        async with self._lock:
            await _to_the_end(self._start(env))

    async def stop(self) -> ports.ExitReport | None:
        """SIGTERM the group, SIGKILL it after the grace period; the exit, or None if never run."""
        async with self._lock:
            return await self._stop(ports.ExitReason.STOPPED)

    async def restart(self, env: Mapping[str, str] | None = None) -> None:
        """Stop the whole group and start the command again, restart count + 1, same agent."""
        async with self._lock:
            await self._stop(ports.ExitReason.RESTARTED)
            self._restart_count += 1
            await _to_the_end(self._start(env))

    def send_signal(self, sig: int) -> None:
        """Forward ``sig`` to the command's process group."""
        if self.running and self._current is not None:
            group.signal_group(self._current.pid, sig)

    async def wait(self) -> ports.ExitReport:
        """The next exit that is not part of a restart (own exit, stop, or failed start)."""
        while True:
            current = self._current
            if current is None:
                raise errors.LocalError("wait() before start()")
            report = await asyncio.shield(current.done)
            if report.reason is not ports.ExitReason.RESTARTED:
                return report
            async with self._lock:
                pass  # the restart that ended ``current`` has started the next incarnation

    async def _start(self, env: Mapping[str, str] | None) -> None:
        if self.running:
            raise errors.LocalError("the command is already running")
        assert self._progress is not None, "use 'async with Supervisor(...)'"
        self._progress.reset()
        child_env, self._flight_request = incarnation.child_env(
            self._env, self._restart_count, self._progress.path, env or {}
        )
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid, status, warm_start = await launch.spawn(
                self._argv, child_env, out_w, err_w, self._reaper, self._warm
            )
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            self._spawn_failed(exc, incarnation.start_step(child_env))
            return
        finally:
            os.close(out_w)
            os.close(err_w)
        if self._settings.foreground:
            group.give_terminal(pid)
        settings = self._settings
        scanner = signatures.Scanner(settings.signatures, keep_lines=settings.keep_lines)
        done = asyncio.get_running_loop().create_future()
        inc = incarnation.Incarnation(pid, self._restart_count, scanner, done, status, warm_start,
                                      start_step=incarnation.start_step(child_env))  # fmt: skip
        self._current = inc
        await self._watch(inc, out_r, err_r)
        log.info("started %s as pid %s (restart %s, %s)", self._argv[0], pid,
                 inc.restart_count, "warm" if inc.warm else "cold")  # fmt: skip

    async def _watch(self, inc: incarnation.Incarnation, out_r: int, err_r: int) -> None:
        """Pass the incarnation's output on; watch for its hangs and its exit; once it runs,
        prepare the next warm start."""
        for read_fd, stream, sink in (
            (out_r, "stdout", self._settings.stdout_fd),
            (err_r, "stderr", self._settings.stderr_fd),
        ):
            inc.pumps.append(await pump.open_pump(
                read_fd, stream, sink, lambda s, b: self._on_line(inc, s, b), inc.heard
            ))  # fmt: skip
        if self._settings.hang_timeout_s != 0:
            inc.watchdog = self._background(self._watch_hangs(inc), f"watchdog-{inc.pid}")
        self._background(self._watch_exit(inc), f"exit-{inc.pid}")
        if self._warm is not None and self._progress is not None:
            prewarm = launch.prewarm_when_running(self._warm, self._progress, inc)
            self._background(prewarm, f"prewarm-{inc.pid}")

    def _spawn_failed(self, exc: OSError, step: int) -> None:
        scanner = signatures.Scanner(self._settings.signatures)
        argv0, count = self._argv[0], self._restart_count
        message, report = incarnation.spawn_failed(argv0, exc, count, scanner, step)
        pump.write_all(self._settings.stderr_fd, message.encode() + b"\n")
        done: asyncio.Future[ports.ExitReport] = asyncio.get_running_loop().create_future()
        done.set_result(report)
        self._current = incarnation.Incarnation(0, self._restart_count, scanner, done)
        self._background(self._report(self._reports.child_exited(report)), "report-exit")

    async def _stop(self, reason: ports.ExitReason) -> ports.ExitReport | None:
        inc = self._current
        if inc is None:
            return None
        if not inc.done.done():
            if inc.reason is None and not (inc.status is not None and inc.status.done()):
                inc.reason = reason
            self._terminate(inc)
        return await asyncio.shield(inc.done)

    def _terminate(self, inc: incarnation.Incarnation) -> asyncio.Task[None]:
        if inc.terminator is None:
            inc.terminator = self._background(
                group.terminate_group(inc.pid, self._settings.grace_s), f"terminate-{inc.pid}"
            )
        return inc.terminator

    async def _watch_exit(self, inc: incarnation.Incarnation) -> None:
        assert inc.status is not None
        raw = await asyncio.shield(inc.status)
        if not inc.warm:
            self._reaper.forget(inc.pid)
        if inc.terminator is not None or group.group_alive(inc.pid):
            await self._terminate(inc)
        # Before the exit is reported (and a restart starts anew): nothing of this incarnation
        # may still hold a GPU, a port or a checkpoint file.
        if (started := self._reaper.started()) is not None:
            await group.terminate_adopted(started, self._settings.grace_s)
        await self._drain(inc)
        if inc.watchdog is not None:
            inc.watchdog.cancel()
        report = incarnation.exit_report(inc, raw, self._step_at_end(inc))
        log.info("pid %s ended: status %s (%s)", inc.pid, report.exit_status, report.reason)
        inc.done.set_result(report)
        await self._report(self._reports.child_exited(report))

    def _on_dying(self, inc: incarnation.Incarnation, text: str) -> None:
        """The command's own process (not one of its children: an evaluation subprocess may
        fail without ending training) says it is exiting on an uncaught exception."""
        said = progress.dying_pid(text)
        if said is None or said[1] != inc.pid or inc.reason is not None or inc.done.done():
            return
        inc.dying = True
        step, seen = self._step_at_end(inc), inc.scanner.evidence()
        report = ports.DyingReport(inc.pid, inc.restart_count, said[0], seen, step)
        self._background(self._report(self._reports.child_dying(report)), "report-dying")

    def _step_at_end(self, inc: incarnation.Incarnation) -> int | None:
        last, now = self.last_step, time.monotonic()  # reading the step updates ever_stepped
        return incarnation.step_at_end(last, inc, ever_stepped=self._ever_stepped, now=now)

    async def _drain(self, inc: incarnation.Incarnation) -> None:
        """Let the pumps pass on what is left; give up on pipes a stray process holds open."""
        waiting = [pump_.done for _, pump_ in inc.pumps]
        if waiting:
            await asyncio.wait(waiting, timeout=DRAIN_TIMEOUT_S)
        for transport, _ in inc.pumps:
            transport.close()

    def _on_line(self, inc: incarnation.Incarnation, stream: str, line: bytes) -> None:
        text = line.decode(errors="replace").rstrip("\r\n")
        for match in inc.scanner.feed(stream, text):
            if match.signature not in inc.reported:
                inc.reported.add(match.signature)
                report = ports.FaultReport(inc.pid, inc.restart_count, match)
                self._background(self._report(self._reports.fault_seen(report)), "report-fault")
        if stream == "stderr" and not inc.dying and progress.DYING_MARKER in text:
            self._on_dying(inc, text)
        if self._observe is not None:
            self._observe(stream, line)

    async def _watch_hangs(self, inc: incarnation.Incarnation) -> None:
        assert self._progress is not None

        async def collect() -> tuple[ports.StackDump, ...]:
            pids = [process.pid for process in group.members(inc.pid)]
            return await stacks.dump_all(self._reaper, pids, self._flight_request)

        async def report(hang: ports.HangReport) -> None:
            await self._report(self._reports.hang_detected(hang))

        def set_hung(hung: bool) -> None:
            inc.hung = hung

        def chosen(timeout_s: float, why: str) -> None:
            self._hang_timeout = f"{timeout_s:.0f} s ({why})"

        policy = hang_policy.HangPolicy(fixed_s=self._settings.hang_timeout_s or None)
        settings = watchdog.WatchSettings(policy, inc.restart_count, inc.started)
        activity = watchdog.TreeActivity(lambda: group.members(inc.pid), inc.started)
        await watchdog.watch(
            settings, self.step_history, self._progress, lambda: inc.last_output_ts, activity,
            collect, report, set_hung, chosen,
        )  # fmt: skip

    async def _report(self, call: Coroutine[Any, Any, None]) -> None:
        try:
            async with asyncio.timeout(REPORT_TIMEOUT_S):
                await call
        except Exception:
            log.exception("a report failed")

    def _background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.create_task(tasks.guarded(coro, name), name=name)


async def _to_the_end(start: Coroutine[Any, Any, None]) -> None:
    """Run ``start`` to its end even when the caller is cancelled meanwhile (a SIGTERM while the
    agent starts the training), then pass the cancellation on. Cut between the spawn and the
    exit watcher, a start left a child nobody watched: its exit never came, and ``stop()``
    waited for it for ever."""
    task = asyncio.ensure_future(start)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
