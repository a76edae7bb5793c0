"""Which pods' heartbeats the master watches, and which have gone silent; which pods it
awaits back, and which have not come back in time (pure: every call takes ``now`` on the
master's monotonic clock)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from aegis.core import events as ev
from aegis.core.model import JobStatus, PodName
from aegis.core.phases import Phase

log = logging.getLogger(__name__)

LINK_CHECK_S = 1.0  # how long the bus has to answer before a pod is judged silent
LINK_SLOW_S = 0.5  # an answer slower than this: the bus was hung until just now
DEAF_LOG_S = 60.0  # how often a bus still lost is said again


@dataclass(slots=True)
class Liveness:
    """A pod is watched from its ACK (or from a takeover, with a full timeout of grace) until
    it is lost, replaced or evicted; ``lost`` names each watched pod silent past the timeout
    once, and stops watching it. A pod sent away (replaced, evicted, or restarted by the
    platform) is awaited from then, and from its placement once the platform placed it, until
    its ACK; ``overdue`` names it again each ``join_timeout_s`` it stays away (0: never). The
    job's first pods are not awaited: a job whose agents cannot reach the master at all runs
    without it (``RunIndependent``)."""

    timeout_s: float
    join_timeout_s: float = 0.0
    last_seen: dict[PodName, float] = field(default_factory=dict)
    watched: set[PodName] = field(default_factory=set)
    awaited: dict[PodName, float] = field(default_factory=dict)  # pod -> awaited since
    deaf: bool = False  # the master's own connection is lost (``hearing``)
    deaf_since: float = 0.0
    told: float = 0.0  # when the lost bus was last logged

    def seen(self, pod: PodName, now: float) -> None:
        self.last_seen[pod] = now

    def watch(self, pod: PodName) -> None:
        """Watch ``pod``'s heartbeats (it ACKed: it is back, if it was away)."""
        self.watched.add(pod)
        self.awaited.pop(pod, None)

    def watch_from(self, pods: Iterable[PodName], now: float) -> None:
        """Watch ``pods`` as if each had just been heard (a takeover's grace)."""
        for pod in pods:
            self.last_seen[pod] = now
            self.watched.add(pod)

    def taken_over(self, status: JobStatus, now: float) -> None:
        """A new leader watches every pod that was running (or is done), a full timeout of
        grace from ``now``; a pod pending or restarting is watched from its ACK, and awaited
        from ``now`` if it was sent away (restarting) or the job has started: only the job's
        first pods are never awaited."""
        for pod, info in status.pod_infos.items():
            if info.inner_phase not in (Phase.PENDING, Phase.RESTARTING) or info.finished:
                self.watch_from((pod,), now)
            elif status.phase is not Phase.PENDING or info.inner_phase is Phase.RESTARTING:
                self.awaited.setdefault(pod, now)

    def hearing(self, connected: bool, now: float, job: str = "", answered_s: float = 0.0) -> bool:
        """Whether silences may be judged now: not while the master's own connection is lost
        (``connected`` False: it hears nobody, so no pod's silence says anything), nor when
        its bus took longer than ``LINK_SLOW_S`` to answer (``answered_s``: it was hung until
        just now, and what the pods sent meanwhile may not have arrived yet). Once it is back,
        every watched pod has a full timeout from ``now``, and every pod awaited back a full
        join timeout (it could not be heard joining)."""
        if not connected or (answered_s > LINK_SLOW_S and not self.deaf):
            if not self.deaf:
                log.warning("job %s: the bus is lost: no pod is judged silent meanwhile", job)
                self.deaf_since = self.told = now
            elif now - self.told >= DEAF_LOG_S:
                log.warning("job %s: still no bus, for %.0f s", job, now - self.deaf_since)
                self.told = now
            self.deaf = True
            return False
        if self.deaf:
            log.warning("job %s: the bus is back after %.0f s: every pod has a full timeout from "
                        "now", job, now - self.deaf_since)  # fmt: skip
            self.last_seen.update(dict.fromkeys(self.watched, now))
            self.awaited.update(dict.fromkeys(self.awaited, now))
            self.deaf = False
        return True

    def forget(self, pod: PodName, now: float) -> None:
        """Stop watching ``pod``: it leaves, is replaced or was placed anew; it is awaited back
        from ``now`` (a placement starts the wait again: pulling and starting take time)."""
        self.watched.discard(pod)
        self.awaited[pod] = now

    def _silent(self, pod: PodName, now: float) -> bool:
        return now - self.last_seen.get(pod, now) > self.timeout_s

    def _late(self, since: float, now: float) -> bool:
        return self.join_timeout_s > 0 and now - since > self.join_timeout_s

    def due(self, now: float) -> bool:
        """Whether ``overdue`` would name a pod now (it changes nothing)."""
        return any(self._silent(p, now) for p in self.watched) or any(
            self._late(since, now) for since in self.awaited.values()
        )

    def lost(self, now: float) -> list[PodName]:
        gone = sorted(p for p in self.watched if self._silent(p, now))
        self.watched.difference_update(gone)
        return gone

    def not_back(self, now: float) -> list[PodName]:
        """The pods awaited for longer than the join timeout, each named once per timeout."""
        late = sorted(p for p, since in self.awaited.items() if self._late(since, now))
        self.awaited.update(dict.fromkeys(late, now))
        return late

    def overdue(self, now: float) -> list[ev.HeartbeatLost | ev.JoinTimedOut]:
        """The events of pods silent past the heartbeat timeout, and of pods not back within
        the join timeout."""
        waited = f"did not come back within {self.join_timeout_s:.0f} s"
        lost: list[ev.HeartbeatLost | ev.JoinTimedOut] = [
            ev.HeartbeatLost(p) for p in self.lost(now)
        ]
        return [*lost, *(ev.JoinTimedOut(p, waited) for p in self.not_back(now))]
