"""The live view of ``aegis run`` on a terminal: a ``rich`` table of pods (node, inner phase,
retries, last event) under the job phase and the restart line, with a step progress bar when
training reports progress (checkpoint commits, and heartbeats once agents carry ``step``).

``render`` is pure (state in, renderable out) so it can be tested on a recorded console;
``LiveView`` feeds it from the runner's observer hooks and refreshes a ``rich.live.Live``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from dataclasses import dataclass, field

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from aegis.cli.run_view import WatchedJob
from aegis.core import actions as act
from aegis.core import endings
from aegis.core import events as ev
from aegis.core.model import JobSpec, JobStatus, PodName, pods_by_rank
from aegis.core.phases import Phase
from aegis.platforms.local import LocalPlatform
from aegis.wire import messages as m
from aegis.wire.logsafe import terminal_safe

PHASE_STYLE = {
    Phase.PENDING: "dim", Phase.BOOT_CHECKING: "cyan", Phase.RUN_COMMAND: "green",
    Phase.RESTARTING: "yellow", Phase.TROUBLESHOOTING: "magenta", Phase.SUCCEED: "bold green",
    Phase.FAILED: "bold red",
}  # fmt: skip


@dataclass(slots=True)
class ViewState:
    spec: JobSpec
    status: JobStatus
    last_event: dict[str, tuple[float, str]] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    total_steps: int | None = None
    started: float = field(default_factory=time.time)


def event_text(event: ev.Event) -> tuple[str, str] | None:
    """(pod, short text) for an event about one pod."""
    match event:
        case ev.PodAcked(pod=pod):
            return pod, "acked"
        case ev.ChecksReported(pod=pod, verdict=verdict, reason=reason):
            return pod, f"checks: {verdict.value}" + (f" ({reason})" if reason else "")
        case ev.PodFinished(pod=pod, exit_code=code):
            return pod, f"exited {code}"
        case ev.PodErrored(pod=pod, reason=reason):
            return pod, f"error: {reason}"
        case ev.HangReported(pod=pod, reason=reason):
            return pod, reason
        case ev.HeartbeatLost(pod=pod):
            return pod, "heartbeat lost"
        case ev.JoinTimedOut(pod=pod, reason=reason):
            return pod, f"{reason}: placed elsewhere"
        case ev.PodRestarted(pod=pod, node=node):
            return pod, f"restarted on {node}" if node else "restarted"
        case _:
            return None


def action_text(action: act.Action) -> tuple[str, str] | None:
    match action:
        case act.EvictPod(pod=pod, level=level):
            return pod, f"evicted (level {int(level)})"
        case act.ReplacePod(pod=pod):
            return pod, "being replaced"
        case _:
            return None


def user_line(spec: JobSpec, status: JobStatus, hardware: int) -> str:
    restarted = endings.restarts(spec, status)
    return (
        f"max restarts {spec.max_retry}, restarted {restarted} times; "
        f"hardware problems rescheduled {hardware} times"
    )


def render(state: ViewState, now: float | None = None) -> RenderableType:
    spec, status = state.spec, state.status
    now = time.time() if now is None else now
    header = Text.assemble(
        (f"job {spec.job} ", "bold"),
        (status.phase.value, PHASE_STYLE[status.phase]),
        f"  {user_line(spec, status, len(status.error_nodes))}",
        f"  ({now - state.started:.0f} s)",
    )
    table = Table(expand=False, show_edge=True)
    for column in ("pod", "node", "inner phase", "retries", "step", "last event"):
        table.add_column(column)
    for pod, info in pods_by_rank(status):
        seen = state.last_event.get(pod)
        last = "-" if seen is None else f"{_clock(seen[0])} {seen[1]}"
        step = state.steps.get(pod)
        table.add_row(
            pod, info.node or "-", Text(info.inner_phase.value, PHASE_STYLE[info.inner_phase]),
            str(info.retries), "-" if step is None else str(step), Text(terminal_safe(last)),
        )  # fmt: skip
    parts: list[RenderableType] = [header, table]
    if state.steps:
        slowest = min(state.steps.values())
        if state.total_steps:
            bar = ProgressBar(total=state.total_steps, completed=min(slowest, state.total_steps),
                              width=40)  # fmt: skip
            parts.append(_bar_row(bar, slowest, state))
        else:
            parts.append(Text(f"step {slowest} (slowest pod)"))
    if status.error_nodes:
        nodes = ", ".join(e.node for e in status.error_nodes)
        parts.append(Text(terminal_safe(f"error nodes: {nodes}")))
    return Group(*parts)


def _bar_row(bar: ProgressBar, slowest: int, state: ViewState) -> Table:
    grid = Table.grid()
    grid.add_row(bar, f" step {slowest}/{state.total_steps}")
    return grid


def _clock(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


class ConsoleLogHandler(logging.Handler):
    """Log records printed on the live view's console: while the table is shown they go above
    it, where ``rich`` keeps track of them. A line written to the terminal past ``Live`` (a
    handler on ``sys.stderr``) moves the cursor under its feet, and every refresh after it
    leaves a stale copy of the header and the table's top on the screen."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.print(Text(terminal_safe(self.format(record))))
        except Exception:
            self.handleError(record)


class LiveView:
    """Feeds ``render`` from a runner and keeps a ``rich.live.Live`` on ``console`` refreshed.
    Anything else this process shows while it runs goes through ``console`` (``log_handler``)."""

    def __init__(self, console: Console, *, total_steps: int | None = None) -> None:
        self.console = console
        self.total_steps = total_steps
        self.state: ViewState | None = None
        self.live: Live | None = None
        self.tick_s = 0.5
        self._ticker: asyncio.Task[None] | None = None

    def log_handler(self) -> logging.Handler:
        return ConsoleLogHandler(self.console)

    def attach(self, runner: WatchedJob, platform: LocalPlatform) -> None:
        self.state = ViewState(runner.spec, runner.status, total_steps=self.total_steps)
        runner.listeners.append(self.on_event)
        runner.message_listeners.append(self.on_message)
        runner.heartbeat_listeners.append(self.on_message)
        # Refreshed from the event loop (no refresh thread): agents are forked from this
        # thread, and a second thread writing the terminal at fork time is asking for trouble.
        self.live = Live(self, console=self.console, auto_refresh=False, transient=False)
        self.live.start(refresh=True)
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="live-view")

    def __rich__(self) -> RenderableType:
        assert self.state is not None
        return render(self.state)

    def on_event(
        self, runner: WatchedJob, event: ev.Event, actions: tuple[act.Action, ...]
    ) -> None:
        assert self.state is not None
        self.state.status = runner.status
        now = runner.clock()
        about = event_text(event)
        if about is not None:
            self.state.last_event[about[0]] = (now, about[1])
        if isinstance(event, ev.CheckpointCommitted):  # every pod has committed this step
            for pod in runner.status.pod_infos:
                self.state.steps[pod] = max(self.state.steps.get(pod, 0), event.step)
        for action in actions:
            about = action_text(action)
            if about is not None:
                self.state.last_event[about[0]] = (now, about[1])
        if self.live is not None:
            self.live.refresh()

    async def _tick(self) -> None:
        while self.live is not None and self.live.is_started:
            await asyncio.sleep(self.tick_s)
            self.live.refresh()

    def on_message(self, runner: WatchedJob, msg: m.Message) -> None:
        assert self.state is not None
        match msg.data:
            case m.HeartbeatData(step=step) if step is not None:
                self.state.steps[PodName(msg.pod)] = step
            case m.CheckpointData(step=step):
                for pod in runner.status.pod_infos:
                    self.state.steps[pod] = max(self.state.steps.get(pod, 0), step)
            case _:
                pass

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self.live is not None:
            self.live.refresh()
            self.live.stop()
