"""The structured fault log (``faults.jsonl``) and the incident tracker it shares with metrics.

One JSON object per line, for any log collector: the seed's fields ``pod, pod_ip, node, node_ip,
ts, phase, message`` plus ``job``, ``kind`` (``phase_start``, ``phase_end``, ``report``,
``decision``), ``incident`` (id, or null outside an incident) and ``level`` (a recovery level
name, or null). The file is rotated by size (``faults.jsonl.1`` .. ``.N``, newest first).

Incidents open and close by the rule of ``core.incidents`` (the metrics and ``aegis incidents``
over a replayed ``events.jsonl`` use it too, so ids agree).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.incidents import IncidentTracker
from aegis.core.model import PodName
from aegis.core.phases import TERMINAL_PHASES, Order, Phase
from aegis.core.recovery import LEVEL_NAMES, RecoveryLevel
from aegis.master.job_runner import JobRunner
from aegis.wire import messages as m

log = logging.getLogger(__name__)


class RotatingJsonLines:
    """Appends JSON lines to ``path``; past ``max_bytes`` the file becomes ``path.1`` (older ones
    shift up to ``path.<backups>``, the oldest is dropped). A line is never split."""

    def __init__(self, path: Path, *, max_bytes: int = 10 * 1024 * 1024, backups: int = 3) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("ab")

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()
        size = self._file.tell()
        if size > 0 and size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        for index in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            newer = (
                self.path if index == 1 else self.path.with_name(f"{self.path.name}.{index - 1}")
            )
            if newer.exists():
                os.replace(newer, older)
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        self._file = self.path.open("ab")

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True, slots=True)
class FaultLogSettings:
    max_bytes: int = 10 * 1024 * 1024
    backups: int = 3
    node_ip: Callable[[str], str] = field(default=lambda node: "")


class FaultLog:
    """Writes ``faults.jsonl`` for one job from the runner's observer hooks."""

    def __init__(
        self,
        path: Path,
        settings: FaultLogSettings | None = None,
        *,
        out: RotatingJsonLines | None = None,
    ) -> None:
        """``out``: a file shared with other jobs' fault logs (a master leading several; each
        line names its job), else ``path`` is this job's own."""
        self.settings = settings or FaultLogSettings()
        self.out = out or RotatingJsonLines(
            path, max_bytes=self.settings.max_bytes, backups=self.settings.backups
        )
        self.phase: Phase | None = None
        self.tracker: IncidentTracker | None = None

    def attach(self, runner: JobRunner) -> None:
        self.tracker = IncidentTracker(runner.spec.job)
        self.phase = runner.status.phase
        self._write(runner, kind="phase_start", message=f"job created in {self.phase.value}")
        runner.message_listeners.append(self.on_message)
        runner.listeners.append(self.on_event)

    def on_message(self, runner: JobRunner, msg: m.Message) -> None:
        text = report_text(msg)
        if text is not None:
            self._write(runner, kind="report", pod=msg.pod, message=text, phase=msg.phase)

    def on_event(self, runner: JobRunner, event: ev.Event, actions: tuple[act.Action, ...]) -> None:
        assert self.tracker is not None and self.phase is not None
        now, before, after = runner.clock(), self.phase, runner.status
        if isinstance(
            event,
            ev.HeartbeatLost
            | ev.JoinTimedOut
            | ev.NodeDown
            | ev.PodRestarted
            | ev.QuitRequested
            | ev.DrainRequested
            | ev.DrainForced
            | ev.SlowdownReported,
        ):
            pod = getattr(event, "pod", ",".join(getattr(event, "pods", ())))
            self._write(runner, kind="report", pod=pod, phase=before,
                        message=_platform_text(event, actions))  # fmt: skip
        closed = self.tracker.feed(before, event, after, actions, now).closed
        incident = closed or self.tracker.current
        for action in actions:
            text, pod, level = decision_text(action)
            if text is not None:
                self._write(runner, kind="decision", pod=pod, message=text, phase=before,
                            incident=incident.id if incident else None,
                            level=LEVEL_NAMES[level] if level else None)  # fmt: skip
        if after.phase is not before:
            self._write(runner, kind="phase_end", message=f"{before.value} ended", phase=before,
                        incident=incident.id if incident else None)  # fmt: skip
            self._write(runner, kind="phase_start", message=f"{after.phase.value} started",
                        incident=incident.id if incident and not closed else None)  # fmt: skip
            self.phase = after.phase
        if closed is not None:
            self._write(runner, kind="decision", phase=after.phase, incident=closed.id,
                        level=closed.level_name,
                        message=f"incident closed: {after.phase.value} after "
                        f"{(closed.closed_ts or now) - closed.opened_ts:.1f} s")  # fmt: skip
        if after.phase in TERMINAL_PHASES:
            self.out.close()

    def _write(
        self,
        runner: JobRunner,
        *,
        kind: str,
        message: str,
        pod: str = "",
        phase: Phase | None = None,
        incident: str | None = None,
        level: str | None = None,
    ) -> None:
        if self.out.closed:
            return
        info = runner.status.pod_infos.get(PodName(pod)) if pod else None
        node = str(info.node) if info else ""
        if incident is None and self.tracker is not None and self.tracker.current is not None:
            incident = self.tracker.current.id
        self.out.write({
            "job": runner.spec.job, "namespace": runner.spec.namespace, "kind": kind,
            "pod": pod, "pod_ip": info.pod_ip if info else "", "node": node,
            "node_ip": self.settings.node_ip(node) if node else "", "ts": runner.clock(),
            "phase": (phase or runner.status.phase).value, "message": message,
            "incident": incident, "level": level,
        })  # fmt: skip


def report_text(msg: m.Message) -> str | None:
    """A one-line account of an agent's report (None for messages that are no report)."""
    match msg.data:
        case m.ErrorData(reason=reason, fault_class=cls, exit_code=code, lines=lines):
            head = f"error: {cls + ': ' if cls else ''}{reason}"
            tail = f" (exit code {code})" if code is not None else ""
            return head + tail + (f"; {lines[-1]}" if lines else "")
        case m.HangData(idle_s=idle_s):
            return f"hang: no progress for {idle_s:.1f} s"
        case m.ChecksData(response=response):
            failed = [f"{r.check_type}: {r.result}" for r in response.results if not r.passed]
            return "checks failed: " + "; ".join(failed) if failed else "checks passed"
        case m.ExitData(exit_code=code):
            return f"training exited {code}"
        case m.CheckpointStoreData(opened=True, errno=code, strerror=text, directory=where,
                                   step=step):  # fmt: skip
            return (
                f"checkpoint store down: [Errno {code}] {text}: {where}; step {step} kept "
                "in memory, training goes on"
            )
        case m.CheckpointStoreData(ok=True, directory=where, down_s=down_s, step=step):
            return f"checkpoint store back: {where} after {down_s:.1f} s; step {step} committed"
        case _:
            return None


def decision_text(action: act.Action) -> tuple[str | None, str, RecoveryLevel | None]:
    match action:
        case act.RecordFault(pod=pod, reason=reason, counted=counted):
            return f"fault {'counted' if counted else 'not counted'}: {reason}", pod, None
        case act.EvictPod(pod=pod, level=level, reason=reason):
            return f"evict (level {int(level)}): {reason}", pod, level
        case act.ReplacePod(pod=pod, reason=reason):
            return f"replace pod: {reason}", pod, RecoveryLevel.CONTAINER
        case act.BlacklistNode(node=node, reason=reason):
            return f"node {node} joins ErrorNodes: {reason}", "", None
        case act.SendOrder(order=Order.RESTART):
            return "restart every pod in place", "", RecoveryLevel.IN_PLACE
        case act.EndJob(phase=phase, reason=reason):
            return f"job {phase.value}: {reason}", "", None
        case _:
            return None, "", None


def _platform_text(event: ev.Event, actions: tuple[act.Action, ...] = ()) -> str:
    match event:
        case ev.HeartbeatLost():
            return "heartbeat lost"
        case ev.JoinTimedOut(reason=reason):
            if any(isinstance(a, act.BlacklistNode) for a in actions):
                return f"{reason}: its node is blacklisted, the pod is placed elsewhere"
            return f"{reason}: the pod is asked for again"
        case ev.NodeDown(node=node, reason=reason):
            return f"node {node} is down ({reason}): no pod goes there again"
        case ev.PodRestarted(node=node):
            return f"pod restarted on {node}" if node else "pod restarted"
        case ev.QuitRequested(reason=reason):
            return f"quit requested: {reason}"
        case ev.DrainRequested(reason=reason):
            return f"node drained ({reason}): checkpoint requested, leaves at the commit"
        case ev.DrainForced(reason=reason):
            return f"drain stops waiting for a checkpoint: {reason}"
        case ev.SlowdownReported(reason=reason):
            return f"training slowed down ({reason}): the checks look for a slow node"
        case _:
            return type(event).__name__
