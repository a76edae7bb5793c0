"""What ``aegis run`` prints while the job runs: one timestamped line per phase change, fault
and decision (the plain view for pipes and CI)."""

from __future__ import annotations

import datetime
import logging
import sys
from typing import Any, Protocol, TextIO

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Phase
from aegis.platforms.local import LocalPlatform
from aegis.wire.logsafe import terminal_safe


class WatchedJob(Protocol):
    """What a view watches: a ``JobRunner`` in this process, or a ``FollowedJob`` (a job led by
    master processes, read from its event log). Listeners are called with the job, the event
    and the core's actions, after the status moved."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def status(self) -> JobStatus: ...
    @property
    def listeners(self) -> list[Any]: ...
    @property
    def message_listeners(self) -> list[Any]: ...
    @property
    def heartbeat_listeners(self) -> list[Any]: ...
    def clock(self) -> float: ...


# Log records (logger, message template) that say again what a view says in its own words:
# the fault (its "fault:" line, the table's last event) and the node joining ErrorNodes (its
# "decision:" lines, the error nodes line). ``--verbose`` shows them.
SHOWN_BY_THE_VIEW = frozenset({
    ("aegis.master.job_runner", "job %s: fault of %s (%s), counted=%s"),
    ("aegis.platforms.local", "node %s blacklisted: %s"),
})  # fmt: skip


class TerminalSafeStream:
    """What is written goes to ``inner`` escaped (:func:`terminal_safe`): the log lines of
    ``aegis run`` on stderr carry peers' reasons."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        return self.inner.write(terminal_safe(text))

    def flush(self) -> None:
        self.inner.flush()


class NotShownByTheView(logging.Filter):
    """Lets through the log records that a view does not already show (``SHOWN_BY_THE_VIEW``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.name, record.msg) not in SHOWN_BY_THE_VIEW


class PlainView:
    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.phase: Phase | None = None

    def attach(self, runner: WatchedJob, platform: LocalPlatform) -> None:
        runner.listeners.append(self.on_event)
        self._line(
            f"job {runner.spec.job}: {runner.spec.worker_num} pods, "
            f"max_retry {runner.spec.max_retry}"
        )

    def on_event(
        self, runner: WatchedJob, event: ev.Event, actions: tuple[act.Action, ...]
    ) -> None:
        status = runner.status
        if isinstance(event, ev.SlowdownReported) and status.phase is Phase.TROUBLESHOOTING:
            self._line(f"slowdown: {event.reason}")
        for action in actions:
            match action:
                case act.RecordFault(pod=pod, reason=reason, counted=counted):
                    note = "counted" if counted else "not counted"
                    self._line(f"fault: {pod}: {reason} ({note})")
                case act.EvictPod(pod=pod, level=level, reason=reason):
                    self._line(f"decision: {pod} leaves its node (level {int(level)}): {reason}")
                case act.BlacklistNode(node=node):
                    self._line(f"decision: node {node} joins ErrorNodes")
                case act.SendOrder(order=order, seq=seq):
                    self._line(f"order: {order.value} (round {seq})")
                case _:
                    pass
        restarted = self.phase is not None and act.back_to_training(
            self.phase, status.phase, actions
        )
        if status.phase is not self.phase or restarted:  # a software fault: RunCommand again
            self.phase = status.phase
            retries = ",".join(str(i.retries) for _, i in sorted(status.pod_infos.items()))
            self._line(
                f"phase {status.phase.value}: recover_count {status.recover_count}, "
                f"retries ({retries})"
            )

    def _line(self, text: str) -> None:
        now = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        print(f"{now} aegis: {terminal_safe(text)}", file=self.out, flush=True)
