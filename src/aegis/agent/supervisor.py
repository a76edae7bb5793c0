"""The supervisor of the training command: start, stop, restart in place, wait; evidence as it runs.

Drive it from one event loop (the master link will)::

    async with reaper.Reaper() as the_reaper:
        async with Supervisor(argv, settings, the_reaper, reports) as sup:
            await sup.start()                   # spawn the command in its own process group
            await sup.restart({"MASTER_PORT": "29501"})  # stop the group, start again, count+1
            sup.send_signal(signal.SIGUSR1)     # forward a signal to the group
            report = await sup.wait()           # the next exit that was not a restart
            await sup.stop()                    # SIGTERM the group, grace, SIGKILL

Each incarnation's environment is the supervisor's plus ``AEGIS_RESTART_COUNT`` (0, 1, ...),
``AEGIS_PROGRESS_FILE``, the override given to :meth:`start`/:meth:`restart`, and a
``PYTHONPATH`` with :data:`aegis.autoprogress.SITE_DIR` first (unless ``AEGIS_AUTO_PROGRESS=0``):
each of its Python processes reports optimizer steps and an uncaught exception at once, whether
or not the script imports aegis. Its stdout and
stderr pass through line by line and feed a signature scanner; a watchdog reports hangs.

With ``SupervisorSettings.prewarm`` a Python command is forked from a warm interpreter (a zygote,
:mod:`aegis.agent.warm`) instead of spawned: same process group, signals, output, watchdog and
exit status; the zygote's nanny reports the exit instead of the reaper.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from aegis import autoprogress, flight
from aegis import training as progress
from aegis.agent import group, hang_policy, ports, pump, reaper, signatures, stacks, warm, watchdog
from aegis.core import errors

log = logging.getLogger(__name__)

RESTART_COUNT_VAR = "AEGIS_RESTART_COUNT"
REPORT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 2.0
PREWARM_POLL_S = 0.05
# What an agent (standalone or under a master) passes on to the command's group as it comes, as
# tini does. SIGTERM is not among them: it stops the agent, which stops the group itself.
FORWARDED_SIGNALS: tuple[signal.Signals, ...] = (
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


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


@dataclasses.dataclass(slots=True, eq=False)
class _Incarnation:
    pid: int
    restart_count: int
    scanner: signatures.Scanner
    done: asyncio.Future[ports.ExitReport]
    status: asyncio.Future[int] | None = None  # the raw wait status (reaper's or nanny's)
    warm: bool = False
    last_output_ts: float = dataclasses.field(default_factory=time.monotonic)
    started: float = dataclasses.field(default_factory=time.monotonic)
    reason: ports.ExitReason | None = None
    terminator: asyncio.Task[None] | None = None
    watchdog: asyncio.Task[None] | None = None
    pumps: list[tuple[asyncio.ReadTransport, pump.LinePump]] = dataclasses.field(
        default_factory=list
    )
    reported: set[str] = dataclasses.field(default_factory=set)
    hung: bool = False
    dying: bool = False  # its process said it is exiting (reported once)


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
        self._current: _Incarnation | None = None
        self._restart_count = 0
        self._lock = asyncio.Lock()
        self._tasks = asyncio.TaskGroup()
        self._progress: watchdog.ProgressFile | None = None
        self._flight_request: str | None = None
        self.step_history = hang_policy.StepHistory()  # the run's steps: calibrates the watchdog
        self.hang_timeout: tuple[float, str] | None = None  # the watchdog's current choice
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.stop()
        finally:
            if self._warm is not None:
                await self._warm.close()
            await self._tasks.__aexit__(exc_type, exc, tb)
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
    def hang_timeout_text(self) -> str:
        """The watchdog's current timeout and how it was chosen ("" before its first look)."""
        if self.hang_timeout is None:
            return ""
        timeout_s, why = self.hang_timeout
        return f"{timeout_s:.0f} s ({why})"

    @property
    def last_step(self) -> int | None:
        """The step the command last reported with ``aegis.progress()``, None if none yet."""
        seen = self.last_progress
        return None if seen is None else seen[0]

    @property
    def last_progress(self) -> tuple[int, float] | None:
        """(step, ``time.monotonic()`` when it ended) of the last report, None if none yet."""
        return self._progress.read() if self._progress is not None else None

    @property
    def last_input_s(self) -> float | None:
        """The last input time the command measured (seconds from a step's end to the next
        forward: the straggler scores), None if none yet."""
        return self._progress.input_s() if self._progress is not None else None

    def request_checkpoint(self, request_id: int, target_step: int, hold_s: float) -> None:
        """Ask the running command for a checkpoint at ``target_step`` (``aegis.checkpoint.
        save_if_requested``), held for up to ``hold_s`` after saving."""
        assert self._progress is not None, "use 'async with Supervisor(...)'"
        hold_until = time.monotonic() + hold_s if hold_s > 0 else 0.0
        self._progress.request_checkpoint(request_id, target_step, hold_until)

    @property
    def takes_checkpoint_requests(self) -> bool:
        """Whether the running command has said it saves on request."""
        return self._progress is not None and self._progress.opted_in()

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
            await self._start(env)

    async def stop(self) -> ports.ExitReport | None:
        """SIGTERM the group, SIGKILL it after the grace period; the exit, or None if never run."""
        async with self._lock:
            return await self._stop(ports.ExitReason.STOPPED)

    async def restart(self, env: Mapping[str, str] | None = None) -> None:
        """Stop the whole group and start the command again, restart count + 1, same agent."""
        async with self._lock:
            await self._stop(ports.ExitReason.RESTARTED)
            self._restart_count += 1
            await self._start(env)

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
        child_env = {
            **self._env,
            RESTART_COUNT_VAR: str(self._restart_count),
            progress.ENV_VAR: self._progress.path,
            **(env or {}),
        }
        path = autoprogress.pythonpath(child_env)
        if path is not None:  # every Python process of the command gets the hooks at start-up
            child_env[autoprogress.PATH_VAR] = path
        self._flight_request = None  # where its flight recorder answers a hang (when it is on)
        if flight.recording(child_env):
            self._flight_request = child_env[flight.REQUEST_VAR] = self._progress.path + ".fr"
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid, status, warm_start = await self._spawn(child_env, out_w, err_w)
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            self._spawn_failed(exc)
            return
        finally:
            os.close(out_w)
            os.close(err_w)
        if self._settings.foreground:
            group.give_terminal(pid)
        loop = asyncio.get_running_loop()
        inc = _Incarnation(
            pid=pid,
            restart_count=self._restart_count,
            scanner=signatures.Scanner(
                self._settings.signatures, keep_lines=self._settings.keep_lines
            ),
            done=loop.create_future(),
            status=status,
            warm=warm_start,
        )
        self._current = inc
        for read_fd, stream, sink in (
            (out_r, "stdout", self._settings.stdout_fd),
            (err_r, "stderr", self._settings.stderr_fd),
        ):
            inc.pumps.append(
                await pump.open_pump(read_fd, stream, sink, lambda s, b: self._on_line(inc, s, b))
            )
        if self._settings.hang_timeout_s != 0:
            inc.watchdog = self._background(self._watch_hangs(inc), f"watchdog-{pid}")
        self._background(self._watch_exit(inc), f"exit-{pid}")
        if self._warm is not None:
            self._background(self._prewarm_when_running(inc), f"prewarm-{pid}")
        log.info(
            "started %s as pid %s (restart %s, %s)",
            self._argv[0],
            pid,
            inc.restart_count,
            "warm" if inc.warm else "cold",
        )

    async def _spawn(
        self, env: Mapping[str, str], out_w: int, err_w: int
    ) -> tuple[int, asyncio.Future[int], bool]:
        """Fork the command from a zygote, or spawn it cold: (pid, its raw status, warm)."""
        if self._warm is not None:
            forked = await self._warm.fork(env, os.getcwd(), out_w, err_w)
            if forked is not None:
                return forked.pid, forked.status, True
        pid = self._reaper.spawn(self._argv, env, fds={1: out_w, 2: err_w})
        return pid, self._reaper.status(pid), False

    async def _prewarm_when_running(self, inc: _Incarnation) -> None:
        """Make the next zygote once ``inc`` has ended or has run a while since its first progress.

        Not sooner: a zygote importing torch would compete for CPU with the starting ranks and
        with the report of an early crash.
        """
        assert self._warm is not None and self._progress is not None
        settings = self._warm.settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.prepare_after_s
        while not inc.done.done() and loop.time() < deadline:
            if self._progress.read() is not None:
                deadline = min(deadline, loop.time() + settings.settle_s)
            await asyncio.sleep(PREWARM_POLL_S)
        seen = await asyncio.to_thread(lambda: warm.native_packages(group.member_pids(inc.pid)))
        self._warm.prepare(seen)

    def _spawn_failed(self, exc: OSError) -> None:
        status = 127 if exc.errno == errno.ENOENT else 126
        message = f"aegis agent: cannot execute {self._argv[0]}: {exc.strerror}"
        pump.write_all(self._settings.stderr_fd, message.encode() + b"\n")
        scanner = signatures.Scanner(self._settings.signatures)
        scanner.feed("agent", message)
        report = ports.ExitReport(
            pid=0,
            restart_count=self._restart_count,
            exit_status=status,
            signal=None,
            reason=ports.ExitReason.SPAWN_FAILED,
            evidence=scanner.evidence(),
        )
        done: asyncio.Future[ports.ExitReport] = asyncio.get_running_loop().create_future()
        done.set_result(report)
        self._current = _Incarnation(0, self._restart_count, scanner, done)
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

    def _terminate(self, inc: _Incarnation) -> asyncio.Task[None]:
        if inc.terminator is None:
            inc.terminator = self._background(
                group.terminate_group(inc.pid, self._settings.grace_s), f"terminate-{inc.pid}"
            )
        return inc.terminator

    async def _watch_exit(self, inc: _Incarnation) -> None:
        assert inc.status is not None
        raw = await asyncio.shield(inc.status)
        if not inc.warm:
            self._reaper.forget(inc.pid)
        if inc.terminator is not None or group.group_alive(inc.pid):
            await self._terminate(inc)
        await self._drain(inc)
        if inc.watchdog is not None:
            inc.watchdog.cancel()
        code = os.waitstatus_to_exitcode(raw)
        sig = -code if code < 0 else None
        fallback = ports.FaultClass.SEGFAULT if sig in (signal.SIGSEGV, signal.SIGBUS) else None
        report = ports.ExitReport(
            pid=inc.pid,
            restart_count=inc.restart_count,
            exit_status=reaper.exit_status(raw),
            signal=sig,
            reason=inc.reason or ports.ExitReason.EXITED,
            evidence=inc.scanner.evidence(fallback_class=fallback),
        )
        log.info("pid %s ended: status %s (%s)", inc.pid, report.exit_status, report.reason)
        inc.done.set_result(report)
        await self._report(self._reports.child_exited(report))

    def _on_dying(self, inc: _Incarnation, text: str) -> None:
        """The command's own process (not one of its children: an evaluation subprocess may
        fail without ending training) says it is exiting on an uncaught exception."""
        said = progress.dying_pid(text)
        if said is None or said[1] != inc.pid or inc.reason is not None or inc.done.done():
            return
        inc.dying = True
        report = ports.DyingReport(inc.pid, inc.restart_count, said[0], inc.scanner.evidence())
        self._background(self._report(self._reports.child_dying(report)), "report-dying")

    async def _drain(self, inc: _Incarnation) -> None:
        """Let the pumps pass on what is left; give up on pipes a stray process holds open."""
        waiting = [pump_.done for _, pump_ in inc.pumps]
        if waiting:
            await asyncio.wait(waiting, timeout=DRAIN_TIMEOUT_S)
        for transport, _ in inc.pumps:
            transport.close()

    def _on_line(self, inc: _Incarnation, stream: str, line: bytes) -> None:
        inc.last_output_ts = time.monotonic()
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

    async def _watch_hangs(self, inc: _Incarnation) -> None:
        assert self._progress is not None

        async def collect() -> tuple[ports.StackDump, ...]:
            pids = [process.pid for process in group.members(inc.pid)]
            return await stacks.dump_all(self._reaper, pids, self._flight_request)

        async def report(hang: ports.HangReport) -> None:
            await self._report(self._reports.hang_detected(hang))

        def set_hung(hung: bool) -> None:
            inc.hung = hung

        def chosen(timeout_s: float, why: str) -> None:
            self.hang_timeout = (timeout_s, why)

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
        return self._tasks.create_task(_guarded(coro, name), name=name)


async def _guarded(coro: Coroutine[Any, Any, None], name: str) -> None:
    try:
        await coro
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("agent task %s failed", name)


@contextlib.contextmanager
def pid1_signals(sup: Supervisor, on_sigterm: Callable[[], None]) -> Iterator[None]:
    """Tini's signal duties in the running event loop, for both agent modes: each of
    :data:`FORWARDED_SIGNALS` goes to the command's current group (none while no command runs),
    SIGTERM calls ``on_sigterm`` (the agent's own stop: SIGTERM to the group, grace, SIGKILL)."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    for sig in FORWARDED_SIGNALS:
        loop.add_signal_handler(sig, sup.send_signal, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, *FORWARDED_SIGNALS):
            loop.remove_signal_handler(sig)
