"""Which pods' heartbeats the master watches, and which have gone silent (pure: every call
takes ``now`` on the master's monotonic clock)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from aegis.core.model import JobStatus, PodName
from aegis.core.phases import Phase


@dataclass(slots=True)
class Liveness:
    """A pod is watched from its ACK (or from a takeover, with a full timeout of grace) until
    it is lost, replaced or evicted; ``lost`` names each watched pod silent past the timeout
    once, and stops watching it."""

    timeout_s: float
    last_seen: dict[PodName, float] = field(default_factory=dict)
    watched: set[PodName] = field(default_factory=set)

    def seen(self, pod: PodName, now: float) -> None:
        self.last_seen[pod] = now

    def watch(self, pod: PodName) -> None:
        self.watched.add(pod)

    def watch_from(self, pods: Iterable[PodName], now: float) -> None:
        """Watch ``pods`` as if each had just been heard (a takeover's grace)."""
        for pod in pods:
            self.last_seen[pod] = now
            self.watched.add(pod)

    def taken_over(self, status: JobStatus, now: float) -> None:
        """A new leader watches every pod that was running (or is done), a full timeout of
        grace from ``now``; a pod pending or restarting is watched from its ACK."""
        self.watch_from(
            (pod for pod, info in status.pod_infos.items()
             if info.inner_phase not in (Phase.PENDING, Phase.RESTARTING) or info.finished),
            now,
        )  # fmt: skip

    def forget(self, pod: PodName) -> None:
        """Stop watching ``pod`` (it leaves, or is replaced)."""
        self.watched.discard(pod)

    def lost(self, now: float) -> list[PodName]:
        gone = sorted(p for p in self.watched if now - self.last_seen.get(p, now) > self.timeout_s)
        self.watched.difference_update(gone)
        return gone
