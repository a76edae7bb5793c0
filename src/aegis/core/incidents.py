"""The incident rule: when an incident opens and closes, whether its fault was counted, and the
recovery level it took. One rule for the master's fault log and metrics (``master.faultlog``,
``master.metrics``) and for ``aegis incidents`` over a replayed event log (``tools.incidents``),
so their ids and levels agree.

An incident opens at the first fault (``RecordFault``), eviction or replacement while none is
open, or when a slowdown stops training for the checks (no fault, but the checks look for a slow
node). It closes when the job is back in ``RunCommand`` or terminal. Its level is the highest
recovery level decided inside it (``in_place`` when a counted fault ended in an in-place
restart). Ids are ``<job>#<n>`` (``demo#1``), never a pod's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import model
from aegis.core.model import JobStatus
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.recovery import LEVEL_NAMES, RecoveryLevel


@dataclass(slots=True)
class Incident:
    id: str
    opened_ts: float
    counted: bool = False
    level: RecoveryLevel | None = None
    closed_ts: float | None = None
    outcome: Phase | None = None

    @property
    def level_name(self) -> str | None:
        return LEVEL_NAMES[self.level] if self.level is not None else None


@dataclass(frozen=True, slots=True)
class Change:
    """What one handled event did to the incidents."""

    opened: Incident | None = None  # opened by this event
    opener: act.Action | None = None  # the action that opened it (None: a slowdown did)
    closed: Incident | None = None  # closed by this event (it may be the one it opened)


_OPENERS = (act.RecordFault, act.EvictPod, act.ReplacePod)


@dataclass(slots=True)
class IncidentTracker:
    """Opens and closes incidents from what the core decided (no I/O)."""

    job: str
    count: int = 0
    current: Incident | None = None

    def feed(
        self,
        before: Phase,
        event: ev.Event,
        after: JobStatus,
        actions: tuple[act.Action, ...],
        now: float,
    ) -> Change:
        """Update from one event the core handled in phase ``before``: ``after`` and
        ``actions`` are what it decided."""
        opened: Incident | None = None
        opener: act.Action | None = None
        if isinstance(event, ev.SlowdownReported) and after.phase is Phase.TROUBLESHOOTING:
            opened = self._open(now)
        for action in actions:
            if isinstance(action, _OPENERS) and self.current is None:
                opened, opener = self._open(now), action
            match action:
                case act.RecordFault(counted=counted):
                    assert self.current is not None
                    self.current.counted |= counted and before is Phase.RUN_COMMAND
                case act.EvictPod(level=level):
                    assert self.current is not None
                    _raise(self.current, level)
                case act.ReplacePod():
                    assert self.current is not None
                    _raise(self.current, RecoveryLevel.CONTAINER)
                case _:
                    pass
        return Change(opened, opener, self._close(before, after, actions, now))

    def _open(self, now: float) -> Incident:
        """The current incident, opened now if none is."""
        if self.current is None:
            self.count += 1
            self.current = Incident(id=model.incident_id(self.job, self.count), opened_ts=now)
        return self.current

    def _close(
        self, before: Phase, after: JobStatus, actions: tuple[act.Action, ...], now: float
    ) -> Incident | None:
        incident = self.current
        if incident is None:
            return None
        back = act.back_to_training(before, after.phase, actions)
        if not back and after.phase not in TERMINAL_PHASES:
            return None
        if back and incident.level is None and incident.counted:
            incident.level = RecoveryLevel.IN_PLACE
        incident.closed_ts, incident.outcome = now, after.phase
        self.current = None
        return incident


def _raise(incident: Incident, level: RecoveryLevel) -> None:
    """The incident's level is the costliest decided in it: the highest number."""
    if incident.level is None or int(level) > int(incident.level):
        incident.level = level
