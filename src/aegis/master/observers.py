"""The observers of a job's loop (metrics, fault log, live view, environment report), guarded.

They are called after each handled event (with its actions), with each accepted agent report
(its evidence: check results, matched lines, stacks) and with each heartbeat. An observer never
stops the job: one that raises (a fault log on a full disk) is counted and logged at a bounded
rate, and the loop goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.wire import messages as m
from aegis.wire.logsafe import RateLimitedLog

log = logging.getLogger(__name__)

S = TypeVar("S")  # what is observed (the job runner), handed to every observer


class Observers(Generic[S]):
    def __init__(self, subject: S, job: str, log_every_s: float = 10.0) -> None:
        self.subject, self.job = subject, job
        self.events: list[Callable[[S, ev.Event, tuple[act.Action, ...]], None]] = []
        self.messages: list[Callable[[S, m.Message], None]] = []
        self.heartbeats: list[Callable[[S, m.Message], None]] = []
        self.failures = 0
        self._log = RateLimitedLog(log, every_s=log_every_s)

    def event(self, event: ev.Event, actions: tuple[act.Action, ...]) -> None:
        for observer in self.events:
            self._call(observer, self.subject, event, actions)

    def message(self, msg: m.Message) -> None:
        for observer in self.messages:
            self._call(observer, self.subject, msg)

    def heartbeat(self, msg: m.Message) -> None:
        for observer in self.heartbeats:
            self._call(observer, self.subject, msg)

    def _call(self, observer: Callable[..., None], *args: Any) -> None:
        try:
            observer(*args)
        except Exception as exc:
            self.failures += 1
            self._log.warning("job %s: an observer failed (%d so far): %r",
                              self.job, self.failures, exc)  # fmt: skip
