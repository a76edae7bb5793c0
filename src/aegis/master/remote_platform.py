"""The Platform port over NATS: the leader publishes pod work for a platform process."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import msgspec

from aegis.adapters.ports import Bus
from aegis.core.model import JobSpec
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.wire import platform_msgs as pm

_encode = msgspec.json.Encoder().encode


class RemotePlatform:
    def __init__(self, bus: Bus, spec: JobSpec, seq: Callable[[], int], epoch: int) -> None:
        self.bus, self.spec, self.seq, self.epoch = bus, spec, seq, epoch
        self.subject = pm.subject(spec.namespace, spec.job, "requests")
        self.blacklist: dict[str, str] = {}  # what this leader asked to keep pods off
        self._ops = itertools.count()

    async def _send(
        self, kind: pm.RequestKind, target: str, key: str = "", **fields: object
    ) -> None:
        key = key or f"{kind.value}:{target}:{self.seq()}"
        request = pm.PlatformRequest(kind=kind, key=key, epoch=self.epoch, **fields)  # type: ignore[arg-type]
        await self.bus.publish(self.subject, _encode(request))

    async def replace_pod(self, job: str, pod: str, reason: str) -> None:
        await self._send(pm.RequestKind.REPLACE, pod, pod=pod, reason=reason)

    async def evict_pod(self, job: str, pod: str, level: RecoveryLevel, reason: str) -> None:
        await self._send(pm.RequestKind.EVICT, pod, pod=pod, level=int(level), reason=reason)

    async def blacklist_node(self, job: str, node: str, reason: str) -> None:
        await self._send(pm.RequestKind.BLACKLIST, node, node=node, reason=reason)

    async def end_job(self, job: str, phase: Phase) -> None:
        await self._send(pm.RequestKind.END, job, phase=phase.value)

    async def resend_events(self) -> None:
        """This leader listens to the job's events now: the platform publishes again the
        events it may have missed (each adoption's own: a job adopted again in the same term
        after its loop died was not listened to in between)."""
        await self._send(pm.RequestKind.RESEND, "", f"resend:{self.epoch}:{next(self._ops)}")

    # -- aegis ctl drain / undrain (node_drains.NodeDrainer) -----------------------------------

    async def drain_node(self, node: str, reason: str) -> None:
        key = f"drain:{node}:{self.epoch}:{next(self._ops)}"  # each operator request runs once
        await self._send(pm.RequestKind.DRAIN, node, key, node=node, reason=reason)

    async def undrain_node(self, node: str) -> None:
        key = f"undrain:{node}:{self.epoch}:{next(self._ops)}"
        await self._send(pm.RequestKind.UNDRAIN, node, key, node=node)
