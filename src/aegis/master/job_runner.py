"""One job in the master: the shell around the core's ``step``.

Everything that reaches the job (agent messages from NATS, platform events) goes through one
queue and is handled in order: log the event to ``events.jsonl``, ``step``, write the new status
to the store (revision-checked) *before* carrying out the actions, then publish orders and call
the platform. Malformed, oversized, wrong-job, stale and duplicate messages are dropped and
counted. Heartbeats are tracked here and reach the core only as ``HeartbeatLost``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from aegis.adapters.nats_auth import job_subject_prefix
from aegis.adapters.nats_server import free_port
from aegis.adapters.ports import Bus, StatusStore
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.errors import LocalError
from aegis.core.model import JobSpec, JobStatus, NodeName, PodName
from aegis.core.phases import TERMINAL_PHASES, Order, Phase
from aegis.master.drops import DropCounter, SeenIds
from aegis.master.eventlog_writer import EventLogWriter
from aegis.master.ports import Platform
from aegis.wire import codec, eventlog, status_json
from aegis.wire import messages as m
from aegis.wire.translate import to_event

log = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class JobSettings:
    heartbeat_timeout_s: float = 5.0
    order_resend_s: float = 5.0
    master_addr: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class _Platform:
    event: ev.Event
    record: eventlog.PlatformRecord


@dataclass(frozen=True, slots=True)
class _Message:
    msg: m.Message
    event: ev.Event


def status_key(spec: JobSpec) -> str:
    return f"{spec.namespace}.{spec.job}"


class JobRunner:
    def __init__(
        self,
        spec: JobSpec,
        status: JobStatus,
        *,
        bus: Bus,
        store: StatusStore,
        platform: Platform,
        settings: JobSettings,
        log_dir: Path | None,
        revision: int | None = None,
        clock: Clock = time.time,
    ) -> None:
        self.spec, self.status = spec, status
        self.bus, self.store, self.platform = bus, store, platform
        self.settings, self.clock = settings, clock
        self.revision = revision
        prefix = job_subject_prefix(spec.namespace, spec.job)
        self.master_subject, self.worker_subject = f"{prefix}.master", f"{prefix}.worker"
        self.events = EventLogWriter(log_dir / "events.jsonl" if log_dir else None)
        self.drops = DropCounter()
        self.seen = SeenIds()
        self.queue: asyncio.Queue[_Platform | _Message | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.last_seen: dict[PodName, float] = {}
        self.watched: set[PodName] = set()
        self.round_orders: list[act.SendOrder] = []
        self.run_env: dict[str, str] = {}
        self.listeners: list[Callable[[JobRunner, ev.Event, tuple[act.Action, ...]], None]] = []
        self.task: asyncio.Task[None] | None = None  # the running loop, set by the service

    # -- inputs --------------------------------------------------------------------------------

    async def on_worker_message(self, subject: str, payload: bytes) -> None:
        """NATS callback for ``<prefix>.worker``: decode strictly, drop and count bad input."""
        try:
            msg = codec.decode(payload)
            event = to_event(msg, job=self.spec.job, namespace=self.spec.namespace)
        except codec.WireError as exc:
            self.drops.add(exc.reason)
            log.warning("job %s: dropped message (%s)", self.spec.job, exc)
            return
        pod = PodName(msg.pod)
        if pod not in self.status.pod_infos:
            self.drops.add("unknown_pod")
            return
        self.last_seen[pod] = time.monotonic()
        if event is None:
            return  # a heartbeat: only its arrival matters
        if not self.seen.check_and_add(msg.id):
            self.drops.add("duplicate_id")
            return
        self.queue.put_nowait(_Message(msg, event))

    def platform_event(self, event: ev.Event) -> None:
        now = self.clock()
        record: eventlog.PlatformRecord
        match event:
            case ev.PodRestarted(pod=pod, node=node, pod_ip=ip):
                record = eventlog.PodRestartedRecord(pod=pod, ts=now, node=node, pod_ip=ip)
                self.last_seen[pod] = time.monotonic()
                self.watched.discard(pod)
            case ev.HeartbeatLost(pod=pod):
                record = eventlog.HeartbeatLostRecord(pod=pod, ts=now)
            case ev.QuitRequested(reason=reason):
                record = eventlog.QuitRequestedRecord(ts=now, reason=reason)
            case _:
                raise LocalError(f"not a platform event: {event!r}")
        self.queue.put_nowait(_Platform(event, record))

    async def wait_done(self) -> None:
        """Until the job is over; raises ``LocalError`` when the job's loop died first."""
        done = asyncio.ensure_future(self.done.wait())
        waiting: set[asyncio.Future[object]] = {done}  # type: ignore[arg-type]
        if self.task is not None:
            waiting.add(self.task)  # type: ignore[arg-type]
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not self.done.is_set():
            done.cancel()
            error = self.task.exception() if self.task and self.task.done() else None
            raise LocalError(f"job {self.spec.job}: its loop ended early: {error!r}") from error

    def close(self) -> None:
        """Stop the loop (and its timers) without an event."""
        self.done.set()
        self.queue.put_nowait(None)

    # -- the loop ------------------------------------------------------------------------------

    async def start(self, nodes: list[str]) -> None:
        """Subscribe, persist the initial status and record JobCreated."""
        self.events.write(eventlog.job_created(self.spec, nodes, self.clock()))
        await self._persist(self.status)
        self._subscription = await self.bus.subscribe(self.worker_subject, self.on_worker_message)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch_heartbeats(), name=f"heartbeats:{self.spec.job}")
            group.create_task(self._resend_orders(), name=f"resend:{self.spec.job}")
            while not self.done.is_set():
                item = await self.queue.get()
                if item is not None:
                    await self._handle(item)
        await self._subscription.unsubscribe()
        self.events.close()

    async def _handle(self, item: _Platform | _Message) -> None:
        now = self.clock()
        if isinstance(item, _Message):
            self.events.write(msgspec.structs.replace(item.msg, ts=now))
        else:
            self.events.write(msgspec.structs.replace(item.record, ts=now))
        before = self.status
        after, actions = machine.step(self.spec, before, item.event, now)
        if after is not before:
            await self._persist(after)
            self._log_transition(before, after, item.event)
        self.status = after
        if isinstance(item, _Message) and isinstance(item.event, ev.PodAcked):
            self.watched.add(item.event.pod)
        for action in actions:
            await self._execute(action)
        for listener in self.listeners:
            listener(self, item.event, actions)

    async def _persist(self, status: JobStatus) -> None:
        payload = json.dumps(status_json.to_dict(self.spec, status)).encode()
        self.revision = await self.store.put(
            status_key(self.spec), payload, expected_revision=self.revision
        )

    def _log_transition(self, before: JobStatus, after: JobStatus, event: ev.Event) -> None:
        if before.phase is not after.phase:
            log.info(
                "job %s: %s -> %s on %s (recover_count %d)",
                self.spec.job,
                before.phase,
                after.phase,
                type(event).__name__,
                after.recover_count,
            )

    # -- actions -------------------------------------------------------------------------------

    async def _execute(self, action: act.Action) -> None:
        job = self.spec.job
        match action:
            case act.SendOrder():
                if action.order in (Order.RUN, Order.RESTART):
                    self.run_env = self._fresh_run_env()
                if not self.round_orders or self.round_orders[-1].seq != action.seq:
                    self.round_orders = []
                self.round_orders.append(action)
                await self._publish_order(action)
            case act.EvictPod(pod=pod, level=level, exit_code=code, reason=reason):
                self.watched.discard(pod)
                order = act.SendOrder(Order.EXIT, self.status.phase, self.status.seq, (pod,), code)
                await self._publish_order(order)
                await self.platform.evict_pod(job, pod, level, reason)
            case act.ReplacePod(pod=pod, reason=reason):
                self.watched.discard(pod)
                await self.platform.replace_pod(job, pod, reason)
            case act.BlacklistNode(node=node, reason=reason):
                await self.platform.blacklist_node(job, node, reason)
            case act.RecordFault(pod=pod, reason=reason, counted=counted):
                log.warning("job %s: fault of %s (%s), counted=%s", job, pod, reason, counted)
            case act.EndJob(phase=phase, reason=reason):
                log.info("job %s ended %s: %s", job, phase, reason)
                self.done.set()
                await self.platform.end_job(job, phase)
            case act.Rejected(reason=reason, detail=detail):
                self.drops.add(reason.value)
                log.debug("job %s: rejected (%s: %s)", job, reason, detail)

    def _fresh_run_env(self) -> dict[str, str]:
        # A fresh rendezvous port for every run round: an incarnation never reuses the
        # TCPStore/gloo addresses of an earlier one.
        return {"MASTER_ADDR": self.settings.master_addr, "MASTER_PORT": str(free_port())}

    async def _publish_order(self, order: act.SendOrder) -> None:
        env = self.run_env if order.order in (Order.RUN, Order.RESTART) else {}
        msg = m.Message(
            job=self.spec.job,
            namespace=self.spec.namespace,
            pod="master",
            type=m.MessageType.ORDER,
            phase=order.phase,
            seq=order.seq,
            ts=self.clock(),
            data=m.OrderData(order.order, list(order.pods), order.exit_code, env),
        )
        await self.bus.publish(self.master_subject, codec.encode(msg))

    # -- timers --------------------------------------------------------------------------------

    async def _watch_heartbeats(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while not self.done.is_set():
            await _sleep_or_done(self.done, min(0.25, timeout / 4))
            now = time.monotonic()
            for pod in list(self.watched):
                if now - self.last_seen.get(pod, now) > timeout:
                    self.watched.discard(pod)
                    log.warning("job %s: %s silent for %.1f s", self.spec.job, pod, timeout)
                    self.platform_event(ev.HeartbeatLost(pod))

    async def _resend_orders(self) -> None:
        """Orders travel at most once on NATS core: re-send the current round's orders while
        pods have not answered (agents ignore a round they already executed)."""
        while not self.done.is_set():
            await _sleep_or_done(self.done, self.settings.order_resend_s)
            if self.done.is_set() or self.status.phase in TERMINAL_PHASES:
                return
            if self.status.outstanding == 0 or self.status.phase is Phase.RESTARTING:
                continue
            for order in self.round_orders:
                if order.seq == self.status.seq:
                    await self._publish_order(order)

    def pod_nodes(self) -> dict[PodName, NodeName]:
        return {pod: info.node for pod, info in self.status.pod_infos.items()}


async def _sleep_or_done(done: asyncio.Event, delay_s: float) -> None:
    try:
        await asyncio.wait_for(done.wait(), timeout=delay_s)
    except TimeoutError:
        return
