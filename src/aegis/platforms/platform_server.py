"""Serves a platform to master replicas over NATS (``aegis run --masters N``).

Requests from the leader are carried out once per idempotency key (a new leader re-issues the
pending work of a round after a takeover); the platform's events go back on the job's events
subject, where whichever replica leads picks them up.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from aegis.adapters.ports import Bus, Subscription
from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master import control
from aegis.master.ports import Platform
from aegis.wire import platform_msgs as pm

log = logging.getLogger(__name__)


class PlatformServer:
    def __init__(self, bus: Bus, platform: Platform, *, namespace: str, job: str) -> None:
        self.bus, self.platform, self.namespace, self.job = bus, platform, namespace, job
        self.handled: set[str] = set()
        self.ended = asyncio.Event()
        self._decoder = msgspec.json.Decoder(pm.PlatformRequest)
        self._encoder = msgspec.json.Encoder()
        self._pending: set[asyncio.Task[None]] = set()
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        subject = pm.subject(self.namespace, self.job, "requests")
        self._subscription = await self.bus.subscribe(subject, self._on)

    async def stop(self) -> None:
        """No more requests (the job is over): its subscription is gone (idempotent)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.unsubscribe()

    def sink(self, event: ev.Event) -> None:
        """The platform's events, published for the leading replica."""
        match event:
            case ev.PodRestarted(pod=pod, node=node, pod_ip=ip):
                out = pm.PlatformEvent(kind="restarted", pod=pod, node=node, pod_ip=ip)
            case ev.QuitRequested(reason=reason):
                out = pm.PlatformEvent(kind="quit", reason=reason)
            case _:
                return
        subject = pm.subject(self.namespace, self.job, "events")
        task = asyncio.create_task(self.bus.publish(subject, self._encoder.encode(out)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _on(self, subject: str, payload: bytes) -> None:
        try:
            request = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("platform: dropped a request: %s", exc)
            return
        if request.key in self.handled:
            return
        self.handled.add(request.key)
        match request.kind:
            case pm.RequestKind.REPLACE:
                await self.platform.replace_pod(self.job, request.pod, request.reason)
            case pm.RequestKind.EVICT:
                level = RecoveryLevel(request.level)
                await self.platform.evict_pod(self.job, request.pod, level, request.reason)
            case pm.RequestKind.BLACKLIST:
                await self.platform.blacklist_node(self.job, request.node, request.reason)
            case pm.RequestKind.END:
                await self.platform.end_job(self.job, Phase(request.phase))
                self.ended.set()
            case pm.RequestKind.DRAIN | pm.RequestKind.UNDRAIN:
                await self._drain(request)

    async def _drain(self, request: pm.PlatformRequest) -> None:
        """The same as ``aegis ctl drain``/``undrain`` on a platform in the master's process."""
        node, platform = request.node, self.platform
        if request.kind is pm.RequestKind.DRAIN:
            log.warning("node %s drained: %s", node, request.reason)
            if isinstance(platform, control.NodeBlacklist):
                platform.blacklist[node] = f"drained: {request.reason}"
            if isinstance(platform, control.NodeDrainer):
                await platform.drain_node(node, request.reason)
            return
        log.warning("node %s undrained", node)
        if isinstance(platform, control.NodeBlacklist):
            platform.blacklist.pop(node, None)
        if isinstance(platform, control.NodeDrainer):
            await platform.undrain_node(node)
