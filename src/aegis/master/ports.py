"""What the master needs from a platform (local processes, Slurm, Kubernetes)."""

from __future__ import annotations

from typing import Protocol

from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel


class Platform(Protocol):
    """Creates, replaces and deletes pods. Reports back through ``JobRunner.platform_event``
    (``PodRestarted`` when a replacement or restarted pod is up)."""

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        """The pod is lost: create a replacement (its node is not known bad)."""
        ...

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        """The pod was told to exit; once it has, place a replacement (elsewhere for levels 3
        and 4, on the same node for level 2)."""
        ...

    async def blacklist_node(self, job: str, node: str, reason: str) -> None: ...

    async def end_job(self, job: str, phase: Phase) -> None:
        """The job is over: stop and delete every pod."""
        ...


class NullPlatform:
    """For a master whose pods are managed by someone else (``aegis master`` with hand-started
    agents): decisions are logged and carried out by the agents' own exits."""

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        return None

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        return None

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        return None

    async def end_job(self, job: str, phase: Phase) -> None:
        return None
