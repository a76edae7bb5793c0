"""Counts of messages the master dropped, by reason (malformed, stale, duplicate, ...)."""

from __future__ import annotations

from collections import Counter, OrderedDict


class DropCounter:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, reason: str) -> None:
        self.counts[reason] += 1

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
