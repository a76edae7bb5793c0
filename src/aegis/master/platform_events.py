"""A remote platform's events for the jobs a replica leads (``platforms.platform_server``
publishes them on each job's events subject): decoded, dropped and counted when malformed, and
handed to the job's runner."""

from __future__ import annotations

import contextlib

import msgspec

from aegis.adapters.ports import Bus, Subscription
from aegis.core import events as ev
from aegis.core.model import NodeName, PodName
from aegis.core.rounds import is_error_node
from aegis.master.job_runner import JobRunner, status_key
from aegis.wire import platform_msgs as pm

_decoder = msgspec.json.Decoder(pm.PlatformEvent)


def decode(payload: bytes) -> ev.Event | None:
    """The core's event for a platform's message; None for one that is malformed or of a kind
    this master does not know (the caller counts it)."""
    try:
        event = _decoder.decode(payload)
    except msgspec.DecodeError:
        return None
    if event.kind == "restarted":
        node = NodeName(event.node) if event.node else None
        return ev.PodRestarted(PodName(event.pod), node, event.pod_ip)
    if event.kind == "node_down" and event.node:
        return ev.NodeDown(NodeName(event.node), event.reason or "node down")
    if event.kind == "quit":
        return ev.QuitRequested(event.reason)
    return None


class PlatformEvents:
    """One subscription per led job, to its platform's events."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.subscriptions: dict[str, Subscription] = {}

    async def follow(self, runner: JobRunner) -> None:
        async def on_event(subject: str, payload: bytes) -> None:
            event = decode(payload)
            if event is None:
                runner.drops.add("platform_malformed")
                return
            if isinstance(event, ev.NodeDown) and is_error_node(runner.status.error_nodes,
                                                                event.node):  # fmt: skip
                return  # said again (a new leader's resend): nothing new, not logged again
            runner.platform_event(event)

        spec = runner.spec
        self.subscriptions[status_key(spec)] = await self.bus.subscribe(
            pm.subject(spec.namespace, spec.job, "events"), on_event
        )

    async def stop_following(self, key: str) -> None:
        subscription = self.subscriptions.pop(key, None)
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
