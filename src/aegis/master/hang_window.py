"""The hang reports of a training round held for the judge's window (``hang_judge`` decides),
then queued as the one judged event, with every report as its evidence."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aegis.core.model import JobStatus
from aegis.master import inbox
from aegis.master.hang_judge import GatherSettings, HangJudge
from aegis.master.job_settings import Clock
from aegis.wire import messages as m


class HangWindow:
    def __init__(
        self,
        settings: GatherSettings,
        *,
        status: Callable[[], JobStatus],
        put: Callable[[inbox.Input], None],
        clock: Clock,
        done: asyncio.Event,
    ) -> None:
        self.judge = HangJudge(settings)
        self.status, self.put, self.clock, self.done = status, put, clock, done

    def hold(self, msg: m.Message) -> bool:
        """Keep a hang report of the current training round (True); False for one that is not
        this round's to judge (the core decides about it, as about any stale report)."""
        try:
            wait = self.judge.hold(self.status(), msg)
        except LookupError:
            return False
        if wait == 0.0:
            self._close(msg.seq)
        elif wait is not None:
            asyncio.get_running_loop().call_later(wait, self._close, msg.seq)
        return True

    def _close(self, seq: int) -> None:
        if self.judge.seq != seq or not self.judge.held or self.done.is_set():
            return  # judged already (every pod reported before the window closed)
        evidence = self.judge.messages()
        event, record = self.judge.judge(self.status(), self.clock())
        self.put(inbox.PlatformInput(event, record, evidence))
