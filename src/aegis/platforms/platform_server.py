"""Serves a platform to master replicas over NATS (``aegis run --masters N``).

Requests from the leader are carried out once per idempotency key (a new leader re-issues the
pending work of a round after a takeover); the platform's events go back on the job's events
subject, where whichever replica leads picks them up. A quit is published again every
``REPEAT_QUIT_S`` until the leader ends the job: one sent before any replica had subscribed to
the job's events (the job was just submitted, or a takeover was under way) would be lost, and
the job would run on (a repeat reaching a job that ended already changes nothing). Each node
found down is published again when a new leader asks (``resend``, once it listens): one
published during a takeover would be lost, and the node never blacklisted (the core ignores a
node it knows already).

Requests are fenced by the leader's epoch, as the agents fence orders: once a request of epoch E
came, one of a lower epoch (a deposed leader that woke from a stall and sent what it had
decided) is dropped and counted in ``stale``, whatever its key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from aegis.adapters.ports import Bus, Subscription
from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master import node_drains
from aegis.master.ports import Platform
from aegis.wire import messages as m
from aegis.wire import platform_msgs as pm

log = logging.getLogger(__name__)

REPEAT_QUIT_S = 1.0


class PlatformServer:
    def __init__(self, bus: Bus, platform: Platform, *, namespace: str, job: str) -> None:
        self.bus, self.platform, self.namespace, self.job = bus, platform, namespace, job
        self.handled: set[str] = set()
        self.ended = asyncio.Event()
        self._decoder = msgspec.json.Decoder(pm.PlatformRequest)
        self._encoder = msgspec.json.Encoder()
        self._pending: set[asyncio.Task[None]] = set()
        self._subscription: Subscription | None = None
        self._repeating: asyncio.Task[None] | None = None
        self.quits_sent = 0
        self.down: dict[str, str] = {}  # node -> reason: every node found down, for a resend
        self.max_epoch = 0  # the newest leader's epoch heard of
        self.stale = 0  # requests of a deposed leader, dropped

    async def start(self) -> None:
        subject = pm.subject(self.namespace, self.job, "requests")
        self._subscription = await self.bus.subscribe(subject, self._on)

    async def stop(self) -> None:
        """No more requests (the job is over): its subscription is gone (idempotent)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.unsubscribe()
        repeating, self._repeating = self._repeating, None
        if repeating is not None:
            repeating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await repeating

    def sink(self, event: ev.Event) -> None:
        """The platform's events, published for the leading replica."""
        match event:
            case ev.PodRestarted(pod=pod, node=node, pod_ip=ip):
                out = pm.PlatformEvent(kind="restarted", pod=pod, node=node, pod_ip=ip)
            case ev.NodeDown(node=node, reason=reason):
                self.down.setdefault(node, reason)
                out = pm.PlatformEvent(kind="node_down", node=node, reason=reason)
            case ev.QuitRequested(reason=reason):
                out = pm.PlatformEvent(kind="quit", reason=reason)
                if self._repeating is None and self._subscription is not None:
                    self._repeating = asyncio.create_task(self._repeat_quit(out))
                    return
            case _:
                return
        self._publish_soon(out)

    def _publish_soon(self, event: pm.PlatformEvent) -> None:
        task = asyncio.create_task(self._publish(event))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, event: pm.PlatformEvent) -> None:
        subject = pm.subject(self.namespace, self.job, "events")
        await self.bus.publish(subject, self._encoder.encode(event))

    async def _repeat_quit(self, quit_event: pm.PlatformEvent) -> None:
        """Until the leader ends the job (or this server stops)."""
        while not self.ended.is_set():
            try:
                await self._publish(quit_event)
                self.quits_sent += 1
            except Exception as exc:  # the connection is back soon: try again
                log.warning("platform: the quit was not published: %s", exc)
            with contextlib.suppress(TimeoutError):  # not wait_for: see adapters.aio
                async with asyncio.timeout(REPEAT_QUIT_S):
                    await self.ended.wait()

    async def _on(self, subject: str, payload: bytes) -> None:
        try:
            request = self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            log.warning("platform: dropped a request: %s", exc)
            return
        if not m.current_epoch(request.epoch, self.max_epoch):
            self.stale += 1
            log.warning("platform: dropped a deposed leader's request %s (epoch %d < %d)",
                        request.key, request.epoch, self.max_epoch)  # fmt: skip
            return
        self.max_epoch = request.epoch
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
            case pm.RequestKind.RESEND:
                for node, reason in self.down.items():
                    self._publish_soon(pm.PlatformEvent(kind="node_down", node=node, reason=reason))

    async def _drain(self, request: pm.PlatformRequest) -> None:
        """The same as ``aegis ctl drain``/``undrain`` on a platform in the master's process."""
        node, platform = request.node, self.platform
        if request.kind is pm.RequestKind.DRAIN:
            log.warning("node %s drained: %s", node, request.reason)
            if isinstance(platform, node_drains.NodeBlacklist):
                platform.blacklist[node] = f"drained: {request.reason}"
            if isinstance(platform, node_drains.NodeDrainer):
                await platform.drain_node(node, request.reason)
            return
        log.warning("node %s undrained", node)
        if isinstance(platform, node_drains.NodeBlacklist):
            platform.blacklist.pop(node, None)
        if isinstance(platform, node_drains.NodeDrainer):
            await platform.undrain_node(node)
