"""What an ``aegis run`` is asked (``RunSettings``), what it is built of (the job's spec, the
local platform's settings, the hosts its pods live on) and what it ends with (``RunResult``):
shared by the in-process run (``local_run``) and the replicated one (``replicated_run``), which
import neither each other nor anything but this for it. Which of the two runs a job is the
command line's choice (``cli.run_cmd``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import shlex
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aegis.agent import pycmd
from aegis.core.errors import AegisError
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Phase
from aegis.core.rendezvous import RendezvousRule
from aegis.platforms import emulated
from aegis.platforms.local import Hosts, LocalSettings, SharedHost
from aegis.platforms.process_pods import pod_settings

log = logging.getLogger(__name__)

# What stops a run: Ctrl-C, a kill, and the terminal that closes (an ssh session that ends).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The same signal again this soon is the same stop, sent twice: GNU ``timeout`` signals its
# command and then its process group; no one presses Ctrl-C twice in a quarter of a second.
ECHO_S = 0.25


class RunStoppedError(AegisError):
    """A signal stopped the run before it had a job to end."""

    def __init__(self, signo: int) -> None:
        super().__init__(f"aegis run got {signal.Signals(signo).name} before the job started")
        self.signo = signo


class RunStop:
    """The :data:`STOP_SIGNALS` a run hears, from before it starts anything until it has
    stopped all it started (:func:`stop_signals`): a signal never kills it half-way, which
    left a NATS server's directory (its keys) in /tmp, or its control file. Before the run has
    a job, a signal cancels the run (its context managers stop what was started; the caller
    turns the cancellation into ``RunStoppedError`` with :meth:`stopped_error`); once a job is
    attached, each signal asks for the job's end; once it ended, signals are only logged. A
    second signal (and each one after it) also kills the run's pods at once (:meth:`on_second`):
    the user will not wait for the training's grace period or its last save; the run's own
    clean-up still runs."""

    def __init__(
        self, main: asyncio.Task[object] | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.got: list[int] = []  # every signal heard, in order
        self._clock, self._last = clock, (0, -math.inf)  # the last signal heard, and when
        self._stops = 0  # the signals heard that were not an echo of the one before
        self.stopped_by: int | None = None  # the first one heard before the job ended
        self._main = main  # the run's task, cancelled by a signal before the job
        self._quit: Callable[[str], None] | None = None
        self._ended = False
        self._cancelled = False  # the run was cancelled here
        self._hurry: Callable[[], None] | None = None  # kills the pods, on a second signal

    def heard(self, sig: signal.Signals) -> None:
        self.got.append(int(sig))
        now, (last, at) = self._clock(), self._last
        self._last = (int(sig), now)
        if int(sig) == last and now - at < ECHO_S:
            log.info("%s again within %g s: the same stop, sent twice", sig.name, ECHO_S)
            return
        self._stops += 1
        hurry = self._hurry if self._stops >= 2 else None  # (a pod that started since, too)
        if hurry is not None:
            log.warning("%s again: the pods are killed now (what they had not saved is lost)",
                        sig.name)  # fmt: skip
            hurry()
        say = log.warning if hurry is None else log.debug  # one line a signal
        if self._ended or self._cancelled:  # the run's own clean-up is never cut short
            say("%s: the run is stopping already", sig.name)
            return
        if self.stopped_by is None:
            self.stopped_by = int(sig)
        if self._quit is not None:
            say("%s: stopping the job", sig.name)
            self._quit(f"aegis run got {sig.name}")
        else:
            log.warning("%s: stopping the run (it has no job yet)", sig.name)
            self.cancel_run()

    def cancel_run(self) -> None:
        """Cancel the run's task (once): a signal came before it had a job to end."""
        if self._main is not None and not self._cancelled:
            self._cancelled = True
            self._main.cancel()

    def attach(self, quit_job: Callable[[str], None]) -> None:
        """The run has a job now: a signal from now on asks ``quit_job`` to end it (and one
        whose cancellation was lost asks at once: :meth:`ask_again`)."""
        self._quit = quit_job
        self.ask_again()

    def ask_again(self) -> None:
        """The run can end its job now (it has made it): a signal that cancelled the run
        before, and still finds it going, asks the job to end. The cancellation was lost on
        the way (3.11's ``wait_for`` in a NATS call swallows one)."""
        if self._quit is None or not self._cancelled or self.stopped_by is None or self._ended:
            return
        name = signal.Signals(self.stopped_by).name
        log.warning("%s: the run went on after it (a lost cancellation): stopping the job", name)
        self._quit(f"aegis run got {name}")

    def on_second(self, hurry: Callable[[], None]) -> None:
        """The run has pods: the second signal, and each one after it, calls ``hurry`` to kill
        them now (it must be idempotent)."""
        self._hurry = hurry

    def ended(self) -> None:
        """The job ended, or the run takes down what it started: a signal from now on changes
        nothing of how the run ends."""
        self._ended = True

    def stopped_error(self) -> RunStoppedError | None:
        """What a cancellation of the run means when a signal before the job made it (None:
        another cancellation, the caller's own)."""
        if not self._cancelled or self.stopped_by is None:
            return None
        return RunStoppedError(self.stopped_by)


@contextlib.contextmanager
def stop_signals() -> Iterator[RunStop]:
    """:data:`STOP_SIGNALS` go to the yielded ``RunStop`` while inside (in the event loop's
    thread, for the current task's run)."""
    loop = asyncio.get_running_loop()
    stop = RunStop(asyncio.current_task())
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.heard, sig)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@dataclass(frozen=True, slots=True)
class RunSettings:
    command: tuple[str, ...]
    nodes: int = 3
    spare_nodes: int = 2
    max_retry: int = 3
    job: str = "job"
    namespace: str = "default"
    hang_timeout_s: float | None = None  # None: each agent calibrates; 0: off
    heartbeat_s: float = 1.0
    health_s: float = 30.0  # between the agents' looks at their GPUs (0: none; agent.health)
    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 60.0  # a pod sent away and not back by then goes elsewhere
    grace_s: float = 5.0
    log_dir: Path | None = None
    status_file: Path | None = None
    nats_url: str | None = None
    inject: Mapping[str, frozenset[str]] = field(default_factory=dict)
    ckpt_dir: Path | None = None  # default: <log_dir>/checkpoints
    masters: int = 1  # > 1: master replicas in their own processes (ReplicatedRun)
    prewarm: str = "auto"  # the agents' warm restarts (AEGIS_PREWARM): auto, 0, or modules
    creds_ttl_s: float | None = 3600.0  # the agents' NATS credentials expire (they fetch anew)
    metrics_port: int = 0  # with masters > 1: master i serves /metrics on metrics_port + i
    metrics_addr: str = "127.0.0.1"
    # the master's pace watch (0 s: off), and when an injected slow node turns slow: at the
    # job's first committed checkpoint two pace windows after the first pod started (a node that
    # slows during training), or from the start
    software_restart: bool = True  # False: every fault gets the checks (JobSpec)
    repeat_limit: int = 3  # the same error at the same step this often in a row: stop (0: never)
    pace_window_s: float = 30.0
    pace_drop: float = 0.3
    slow_from_start: bool = False
    isolate_nodes: bool = False  # an emulated cluster (platforms/emulated.py), run inside it


def node_names(settings: RunSettings) -> tuple[list[str], list[str]]:
    return (
        [f"node-{i}" for i in range(settings.nodes)],
        [f"spare-{i}" for i in range(settings.spare_nodes)],
    )


def unknown_injected(settings: RunSettings) -> str | None:
    """Why ``settings.inject`` names a node this run does not have (a typo would otherwise run
    the job without the fault asked for), or None."""
    nodes, spares = node_names(settings)
    unknown = sorted(set(settings.inject) - set(nodes) - set(spares))
    if not unknown:
        return None
    have = f"{nodes[0]}..{nodes[-1]}" if len(nodes) > 1 else nodes[0]
    if spares:
        have += f", {spares[0]}..{spares[-1]}" if len(spares) > 1 else f", {spares[0]}"
    return f"no node {', '.join(unknown)} in this run (it has {have})"


_PLAIN_WORD = re.compile(r"[\w./+@%-]+")  # a program's name or path, no shell syntax


def _words(command: Sequence[str]) -> Sequence[str] | None:
    """What ``command`` runs, as words: a ``bash -c STRING``'s string split as the shell would
    (None when it cannot be), any other command as it is."""
    if len(command) == 3 and command[0] == "bash" and command[1] == "-c":
        try:
            return shlex.split(command[2])
        except ValueError:
            return None
    return command


def program_of(command: Sequence[str]) -> str | None:
    """The program ``command`` starts, where it can be named before it runs: its first word,
    or for ``bash -c STRING`` the string's first word when that is a plain word; None when
    the shell decides what runs (syntax, an assignment, quoting it cannot split)."""
    words = _words(command)
    if not words:
        return None
    if words is command:
        return command[0]
    return words[0] if _PLAIN_WORD.fullmatch(words[0]) else None


def script_of(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The script a Python command runs (``python train.py ...``, in a ``bash -c`` string
    too); None for any other command."""
    words = _words(command)
    parsed = pycmd.parse(words, env) if words else None
    return parsed.script if parsed is not None else None


def job_spec(settings: RunSettings) -> JobSpec:
    return JobSpec(
        settings.job, settings.namespace, settings.nodes, settings.max_retry,
        settings.software_restart, settings.repeat_limit,
    )  # fmt: skip


def local_settings(settings: RunSettings, log_dir: Path) -> LocalSettings:
    """The local platform's settings for the run's pods, logging under ``log_dir``."""
    nodes, spares = node_names(settings)
    return pod_settings(
        LocalSettings, settings, nodes, spares, log_dir,
        heartbeat_s=settings.heartbeat_s,
        ckpt_dir=settings.ckpt_dir or log_dir / "checkpoints",
        prewarm=settings.prewarm,
        slow_from_start=settings.slow_from_start,
        slow_after_s=2 * settings.pace_window_s,  # the first window measured at full pace
    )  # fmt: skip


def log_dir_of(settings: RunSettings) -> Path:
    """The run's log directory (a new temporary one when none is given), made."""
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="aegis-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


@contextlib.contextmanager
def run_log_dir(settings: RunSettings) -> Iterator[Path]:
    """:func:`log_dir_of`; a temporary one made here that the run left empty (it stopped, or
    could not start, before it had a job) is removed on the way out."""
    log_dir = log_dir_of(settings)
    try:
        yield log_dir
    finally:
        if settings.log_dir is None:
            with contextlib.suppress(OSError):
                log_dir.rmdir()  # only an empty one


@contextlib.asynccontextmanager
async def run_hosts(
    settings: RunSettings, log_dir: Path
) -> AsyncIterator[tuple[Hosts, str, RendezvousRule]]:
    """Where the run's pods live, the address the master's side listens on, and where rounds
    meet: this host, or (``isolate_nodes``) an emulated cluster, torn down afterwards."""
    if not settings.isolate_nodes:
        yield SharedHost(), "127.0.0.1", RendezvousRule()
        return
    nodes, spares = node_names(settings)
    cluster = emulated.EmulatedCluster([*nodes, *spares], log_dir / ".cluster")
    try:
        await cluster.start()
        yield cluster, cluster.bridge_addr, cluster.rule
    finally:
        await cluster.close()


@dataclass(slots=True)
class RunResult:
    spec: JobSpec
    status: JobStatus
    log_dir: Path
    placements: list[tuple[str, str]]
    agent_pids_seen: dict[str, list[int]]
    drops: dict[str, int]
    ended: str = ""  # why the job ended, in the master's words
    stopped_by: int | None = None  # the signal (STOP_SIGNALS) that made aegis run stop it

    @property
    def exit_code(self) -> int:
        """0 when the job succeeded, 128 + the signal's number when a signal stopped it (as a
        shell reports a command a signal ended: 130 for Ctrl-C), else 1."""
        if self.status.phase is Phase.SUCCEED:
            return 0
        return 128 + self.stopped_by if self.stopped_by is not None else 1
