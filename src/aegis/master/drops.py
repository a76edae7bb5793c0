"""Counts of messages the master dropped, by reason (malformed, stale, duplicate, ...): every
drop counted exactly (the metrics read ``counts``), logged at a bounded rate."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict

from aegis.wire.logsafe import RateLimitedLog, shown

log = logging.getLogger(__name__)


class DropCounter:
    def __init__(self, job: str = "", log_every_s: float = 60.0) -> None:
        self.job = job
        self.counts: Counter[str] = Counter()
        self.log = RateLimitedLog(log, log_every_s)

    def add(self, reason: str, detail: str = "") -> None:
        """Count one drop; logged (with ``detail``, truncated and escaped) at most once per
        ``log_every_s``."""
        self.counts[reason] += 1
        if detail:
            self.log.warning(
                "job %s: dropped a message (%s: %s); %d dropped in all",
                self.job, reason, shown(detail, 200), self.total(),
            )  # fmt: skip

    def total(self) -> int:
        return sum(self.counts.values())


class SeenIds:
    """The ids of the last ``capacity`` reports: a re-sent report is processed at most once."""

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def check_and_add(self, report_id: str) -> bool:
        """True when the id is new (and now remembered)."""
        if not report_id:
            return True
        if report_id in self._ids:
            return False
        self._ids[report_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True
