"""The hang reports of a training round held for the judge's window (``hang_judge`` decides),
then queued as the one judged event, with every report as its evidence."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aegis.core.model import JobStatus
from aegis.master import inbox
from aegis.master.hang_judge import GatherSettings, HangJudge
from aegis.master.job_settings import Clock
from aegis.wire import messages as m

log = logging.getLogger(__name__)


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
            self._close(msg.seq, self.judge.opened)
        elif wait is not None:
            asyncio.get_running_loop().call_later(wait, self._close, msg.seq, self.judge.opened)
        return True

    def beat(self, msg: m.Message) -> None:
        """A heartbeat: a held report of a pod whose training moved again is withdrawn; reports
        waiting for pods at work are judged once none is left running (one finished)."""
        judge = self.judge
        if judge.withdraw(self.status(), msg):
            log.info("pod %s: its training moved again: its hang report is withdrawn", msg.pod)
        elif judge.waiting and judge.seq == msg.seq and not judge.waits_for_work(self.status()):
            self._close(judge.seq, judge.opened)

    def _close(self, seq: int, opened: int) -> None:
        judge, loop = self.judge, asyncio.get_running_loop()
        if judge.seq != seq or judge.opened != opened or not judge.held or self.done.is_set():
            return  # judged already (every pod reported before the window closed), withdrawn
        first = judge.waiting_since is None
        if (left := judge.wait_left(self.status(), loop.time())) > 1e-3:
            if first:
                log.warning("hang reports of %s held: with no step signal they wait for %s, "
                            "still at work (a barrier before training?), up to %g s",
                            ", ".join(judge.held), ", ".join(judge.waits_for_work(self.status())),
                            judge.settings.work_s)  # fmt: skip
            loop.call_later(left, self._close, seq, opened)
            return
        evidence = self.judge.messages()
        event, record = self.judge.judge(self.status(), self.clock())
        self.put(inbox.PlatformInput(event, record, evidence))
