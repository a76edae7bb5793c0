"""The event queue of the simulation: a heap ordered by (time, insertion number).

Two events at the same instant come out in the order they were pushed, so a run is a pure
function of its inputs (deterministic for a seed). Time is data: nothing here reads a clock.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from aegis.tools.simulate.faults import Fault


class EventKind(enum.StrEnum):
    FAULT = "fault"  # a fault from the trace
    SAVE_START = "save_start"  # the interval of compute is done: the checkpoint save begins
    SAVE_DONE = "save_done"  # the blocking part of the save is over: training goes on
    COMMIT = "commit"  # the saved checkpoint is durable (Aegis persists in the background)
    RESUME = "resume"  # the recovery is over: training runs again
    END = "end"  # the horizon


@dataclass(frozen=True, slots=True)
class SimEvent:
    time_s: float
    kind: EventKind
    generation: int = 0  # the job incarnation it belongs to; older ones are stale
    fault: Fault | None = None
    progress_s: float = 0.0  # COMMIT: the training progress the checkpoint holds


@dataclass(slots=True)
class EventQueue:
    _heap: list[tuple[float, int, SimEvent]] = field(default_factory=list)
    _pushed: int = 0

    def push(self, event: SimEvent) -> None:
        heapq.heappush(self._heap, (event.time_s, self._pushed, event))
        self._pushed += 1

    def pop(self) -> SimEvent:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)
