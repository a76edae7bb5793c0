"""One job in the master: the shell around the core's ``step``.

Everything that reaches the job (agent messages from NATS, platform events) goes through one
queue and is handled in order, in batches: log each event to ``events.jsonl``, ``step``, then
write the new status *and the round's orders* to the store (revision-checked, one write per
batch) *before* carrying out any action. Malformed, oversized, wrong-job, stale and duplicate
messages are dropped and counted. Heartbeats are tracked here and reach the core only as
``HeartbeatLost``.

High availability: every write and every publish first calls ``fence()``, which raises
``LeadershipLostError`` once this replica's lease is gone; every record and order carries the
leader's ``epoch``. A replica that takes over builds the runner from the stored record
(``takeover``): it re-sends the round's orders (agents ignore a round they already executed),
re-issues pending platform work and restarts heartbeat timers with a grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.nats_server import free_port
from aegis.adapters.ports import Bus, StatusStore
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine, rendezvous, stragglers
from aegis.core.errors import LocalError
from aegis.core.model import JobSpec, JobStatus, PodName
from aegis.core.phases import TERMINAL_PHASES, Order, Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master.drops import DropCounter, SeenIds
from aegis.master.eventlog_writer import EventLogWriter
from aegis.master.hang_judge import GatherSettings, HangJudge
from aegis.master.liveness import Liveness
from aegis.master.pace import Pace, PaceSettings, StragglerWatch
from aegis.master.ports import Platform
from aegis.master.round_orders import TRAINING_ORDERS, RoundOrder, round_env, tie_scores
from aegis.master.safe_points import RequestSettings, SafePoints
from aegis.wire import codec, eventlog, status_json
from aegis.wire import messages as m
from aegis.wire.logsafe import RateLimitedLog
from aegis.wire.translate import to_event

log = logging.getLogger(__name__)

Clock = Callable[[], float]
BATCH_MAX = 2048


class LeadershipLostError(LocalError):
    """This replica no longer holds the lease: it must not write or send anything."""


@dataclass(frozen=True, slots=True)
class JobSettings:
    heartbeat_timeout_s: float = 5.0
    order_resend_s: float = 5.0
    # Where a round's ranks meet (core/rendezvous.py): rank 0's pod address, and a port from
    # the range its pod owns (or, the default, one free on the one host every pod shares).
    rendezvous: rendezvous.RendezvousRule = field(default_factory=rendezvous.RendezvousRule)
    # Chaos switch for failover tests: exit right after persisting a status in this phase,
    # before its orders go out (once: the marker file remembers).
    chaos_exit_after_persist: str = ""
    chaos_marker: Path | None = None
    # Checkpoint on request: asked for when a pod is draining, and when one is marked slow
    # (so it leaves at the next step boundary, not at the next periodic checkpoint).
    checkpoint_on_slow: bool = True
    checkpoint_lead_s: float = 1.0  # the requested step lies this far ahead of the estimate
    checkpoint_hold_s: float = 30.0  # ranks hold after saving, at most this long
    drain_deadline_s: float = 60.0  # default wait for the commit before a drain evicts anyway
    # The pace watch (master/pace.py): a run that slows well below its own pace gets the checks.
    pace: PaceSettings = field(default_factory=PaceSettings)
    # Straggler scores from the pods' step ends (core/stragglers.py); they name the pace
    # watch's slow node, and are exported by the metrics.
    stragglers: stragglers.StragglerSettings = field(default_factory=stragglers.StragglerSettings)
    # A hang is judged from every pod's report of it (master/hang_judge.py).
    hang_gather: GatherSettings = field(default_factory=GatherSettings)


@dataclass(frozen=True, slots=True)
class _Platform:
    event: ev.Event
    record: eventlog.PlatformRecord
    evidence: tuple[m.Message, ...] = ()  # agent reports the record stands for (listeners)


@dataclass(frozen=True, slots=True)
class _Message:
    msg: m.Message
    event: ev.Event


def status_key(spec: JobSpec) -> str:
    return f"{spec.namespace}.{spec.job}"


def _no_fence() -> None:
    return None


class JobRunner:
    def __init__(  # noqa: PLR0913 (its collaborators, keyword-only after spec and status)
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
        epoch: int = 0,
        fence: Callable[[], None] = _no_fence,
        extra: dict[str, Any] | None = None,
        signer: Callable[[bytes], str] | None = None,
    ) -> None:
        """``signer``: signs every order (``Authority.sign_order``; None: a server without auth,
        orders go unsigned)."""
        self.spec, self.status = spec, status
        self.signer = signer
        self.bus, self.store, self.platform = bus, store, platform
        self.settings, self.clock = settings, clock
        self.revision, self.epoch, self.fence = revision, epoch, fence
        self.extra = dict(extra or {})  # stored with the record (token, nodes)
        prefix = job_subject_prefix(spec.namespace, spec.job)
        self.prefix, self.master_subject = prefix, f"{prefix}.master"
        self.worker_subject = worker_subject(prefix, "*")  # every pod's (one token each)
        self.events = EventLogWriter(log_dir / "events.jsonl" if log_dir else None)
        self.drops = DropCounter(spec.job)
        self.seen = SeenIds()
        self.queue: asyncio.Queue[_Platform | _Message | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.mono: Clock = time.monotonic  # heartbeats, deadlines, the pace: never wall time
        self.liveness = Liveness(settings.heartbeat_timeout_s)
        self.round_orders: list[RoundOrder] = []
        requests = RequestSettings(settings.checkpoint_on_slow, settings.checkpoint_lead_s,
                                   settings.checkpoint_hold_s)  # fmt: skip
        self.safe = SafePoints(spec.job, requests)
        self.pace = Pace(settings.pace)
        self.stragglers = StragglerWatch(settings.stragglers)
        self._persist_due = False  # a status write wanted without an event (the straggler named)
        self.hangs = HangJudge(settings.hang_gather)
        self.observer_failures = 0
        self._observer_log = RateLimitedLog(log, every_s=10.0)
        self.listeners: list[Callable[[JobRunner, ev.Event, tuple[act.Action, ...]], None]] = []
        # Observers (metrics, fault log, live view): called after each event is handled, and
        # with each accepted agent message (its evidence: check results, matched lines, stacks).
        self.message_listeners: list[Callable[[JobRunner, m.Message], None]] = []
        self.heartbeat_listeners: list[Callable[[JobRunner, m.Message], None]] = []
        self.task: asyncio.Task[None] | None = None  # the running loop, set by the service
        self._subscription: Any = None

    # -- inputs --------------------------------------------------------------------------------

    async def on_worker_message(self, subject: str, payload: bytes) -> None:
        """NATS callback for ``<prefix>.worker.<pod>``: decode strictly, drop and count bad
        input. A report counts only on its own pod's subject (the one its credentials may
        publish on): pod 1 cannot speak for pod 0."""
        try:
            msg = codec.decode(payload)
            event = to_event(msg, job=self.spec.job, namespace=self.spec.namespace)
        except codec.WireError as exc:
            self.drops.add(exc.reason, str(exc))  # logged at a bounded rate, counted exactly
            return
        pod = PodName(msg.pod)
        if pod not in self.status.pod_infos:
            self.drops.add("unknown_pod", f"from pod {msg.pod}")
            return
        if subject != worker_subject(self.prefix, pod):
            self.drops.add("wrong_pod", f"pod {msg.pod} reported on {subject}")
            return
        self.liveness.seen(pod, self.mono())
        if isinstance(msg.data, m.CheckpointData):
            self._checkpoint_reported(pod, msg.data.step)
            return
        if isinstance(msg.data, m.CheckpointDeclinedData):
            self._checkpoint_declined(pod, msg.data.reason)
            return
        if isinstance(msg.data, m.CheckpointStoreData):
            self._checkpoint_store(pod, msg)
            return
        if event is None:  # a heartbeat: its arrival, and the training step it carries
            if isinstance(msg.data, m.HeartbeatData) and msg.data.step is not None:
                self._step_seen(pod, msg.seq, msg.data)
            if isinstance(msg.data, m.HeartbeatData) and msg.data.hang_timeout:
                # the pod's watchdog, for ``aegis status`` (stored with the next status write)
                self.extra.setdefault("watchdogs", {})[pod] = msg.data.hang_timeout[:300]
            for on_heartbeat in self.heartbeat_listeners:
                self._observe(on_heartbeat, self, msg)
            return
        if not self.seen.check_and_add(msg.id):
            self.drops.add("duplicate_id")
            return
        if isinstance(msg.data, m.HangData) and self._hold_hang(msg):
            return
        self.queue.put_nowait(_Message(msg, event))

    def _hold_hang(self, msg: m.Message) -> bool:
        """A hang report of the current training round waits for the others (hang_judge)."""
        try:
            wait = self.hangs.hold(self.status, msg)
        except LookupError:
            return False  # not this round's: the core decides, as about any stale report
        if wait == 0.0:
            self._judge_hangs(msg.seq)
        elif wait is not None:
            asyncio.get_running_loop().call_later(wait, self._judge_hangs, msg.seq)
        return True

    def _judge_hangs(self, seq: int) -> None:
        if self.hangs.seq != seq or not self.hangs.held or self.done.is_set():
            return  # judged already (every pod reported before the window closed)
        evidence = self.hangs.messages()
        event, record = self.hangs.judge(self.status, self.clock())
        self.queue.put_nowait(_Platform(event, record, evidence))

    def hang_named(self, pod: PodName, reason: str) -> None:
        """A hang of ``pod`` named from outside (``aegis ctl hang``): no window, it is blamed."""
        status = self.status
        report = eventlog.HangReportRecord(pod, 0.0, reason)
        record = eventlog.HangJudgedRecord(pod, status.phase, status.seq, self.clock(), reason,
                                           True, "named by the operator", [report])  # fmt: skip
        event = ev.HangReported(pod, status.phase, status.seq, reason, True)
        self.queue.put_nowait(_Platform(event, record))

    def _checkpoint_reported(self, pod: PodName, step: int) -> None:
        """The safe point is fed to the core once per new step the whole job committed."""
        committed = self.safe.committed(self.status, pod, step)
        if committed is not None:
            self.pace.committed()
            self.extra["committed_step"] = committed  # stored with the next status write
            self.platform_event(ev.CheckpointCommitted(committed))

    def _checkpoint_store(self, pod: PodName, msg: m.Message) -> None:
        """A pod's durable checkpoint directory fails (logged once per outage) or works again;
        the observers (fault log, metrics) see every report."""
        data = msg.data
        assert isinstance(data, m.CheckpointStoreData)
        self.events.write(msgspec.structs.replace(msg, ts=self.clock()))  # aegis incidents
        if data.opened:
            log.error("job %s pod %s: checkpoint store %s down: [Errno %d] %s; step %d kept in "
                      "memory, training goes on", self.spec.job, pod, data.directory, data.errno,
                      data.strerror, data.step)  # fmt: skip
        elif data.ok:
            log.warning("job %s pod %s: checkpoint store %s back after %.1f s", self.spec.job,
                        pod, data.directory, data.down_s)  # fmt: skip
        for on_message in self.message_listeners:
            self._observe(on_message, self, msg)

    def drain(self, pods: tuple[PodName, ...], reason: str, deadline_s: float) -> None:
        """``aegis ctl drain``: these pods leave at the next committed checkpoint (requested
        now), or after ``deadline_s`` without one; no fault is counted."""
        self.safe.drain(pods, deadline_s, self.mono())
        self.platform_event(ev.DrainRequested(pods, reason))

    def _step_seen(self, pod: PodName, seq: int, beat: m.HeartbeatData) -> None:
        now, step = self.mono(), beat.step
        assert step is not None
        self.safe.step_seen(self.status, pod, seq, step, now)
        if seq != self.status.seq or self.status.phase is not Phase.RUN_COMMAND:
            return
        if beat.step_ts is not None and beat.sent_mono is not None:
            self.stragglers.step_seen(
                seq, pod, step, beat.step_ts, beat.sent_mono, now, beat.input_s
            )
            self._stragglers_to_record()
        slowed = self.pace.step_seen(seq, pod, step, now)
        if slowed is not None:
            slowed += self.stragglers.naming(self.pod_nodes())
            log.warning("job %s: training slowed down: %s", self.spec.job, slowed)
            self.platform_event(ev.SlowdownReported(slowed))

    def _stragglers_to_record(self) -> None:
        """The straggler scores for ``aegis status``: with the next status write, and one at
        once when the pod named changes."""
        summary = self.stragglers.summary
        if not summary:
            self.extra.pop("stragglers", None)  # a new round: none yet
        elif summary is not self.extra.get("stragglers"):
            self.extra["stragglers"] = summary
        if self.stragglers.take_named_change():
            self._persist_due = True
            self.queue.put_nowait(None)  # wakes the loop: an empty batch that persists

    def _checkpoint_request(self) -> RoundOrder | None:
        env = self.safe.request(self.status, self.mono())
        if env is None:
            return None
        return RoundOrder(Order.CHECKPOINT, self.status.phase, self.status.seq, (), 0, env)

    def _checkpoint_declined(self, pod: PodName, reason: str) -> None:
        forced = self.safe.declined(self.status, pod, reason)
        if forced is not None:
            self.platform_event(forced)

    def _drain_deadlines_passed(self, now: float) -> None:
        for forced in self.safe.deadlines_passed(self.status, now):
            self.platform_event(forced)

    def platform_event(self, event: ev.Event) -> None:
        now = self.clock()
        record: eventlog.PlatformRecord
        match event:
            case ev.PodRestarted(pod=pod, node=node, pod_ip=ip):
                record = eventlog.PodRestartedRecord(pod=pod, ts=now, node=node, pod_ip=ip)
                self.liveness.seen(pod, self.mono())
                self.liveness.forget(pod)
            case ev.HeartbeatLost(pod=pod):
                record = eventlog.HeartbeatLostRecord(pod=pod, ts=now)
            case ev.QuitRequested(reason=reason):
                record = eventlog.QuitRequestedRecord(ts=now, reason=reason)
            case ev.CheckpointCommitted(step=step):
                record = eventlog.CheckpointCommittedRecord(step=step, ts=now)
            case ev.DrainRequested(pods=pods, reason=reason):
                record = eventlog.DrainRequestedRecord(list(pods), ts=now, reason=reason)
            case ev.DrainForced(pods=pods, reason=reason):
                record = eventlog.DrainForcedRecord(list(pods), ts=now, reason=reason)
            case ev.SlowdownReported(reason=reason):
                record = eventlog.SlowdownReportedRecord(ts=now, reason=reason)
            case _:
                raise LocalError(f"not a platform event: {event!r}")
        self.queue.put_nowait(_Platform(event, record))

    def pod_nodes(self) -> dict[PodName, str]:
        return {pod: info.node for pod, info in self.status.pod_infos.items()}

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

    # -- start: a new job, or a takeover -------------------------------------------------------

    async def start(self, nodes: list[str], pod_ips: list[str] | None = None) -> None:
        """A new job: record JobCreated, persist the initial status, subscribe."""
        self.events.write(eventlog.job_created(self.spec, nodes, self.clock(), pod_ips))
        await self._persist()
        self._subscription = await self.bus.subscribe(self.worker_subject, self.on_worker_message)

    async def takeover(self) -> None:
        """A job loaded from the store by a new leader: continue where the old one stopped."""
        self._subscription = await self.bus.subscribe(self.worker_subject, self.on_worker_message)
        now = self.mono()
        self.liveness.watch_from(  # grace: a full timeout from the takeover
            (pod for pod, info in self.status.pod_infos.items()
             if info.inner_phase not in (Phase.PENDING, Phase.RESTARTING) or info.finished),
            now,
        )  # fmt: skip
        requested = any(
            o.order is Order.CHECKPOINT and o.seq == self.status.seq for o in self.round_orders
        )
        self.safe.taken_over(self.status, requested, self.settings.drain_deadline_s, now)
        await self._persist()  # claims every job key for this epoch: a deposed leader's
        # next revision-checked write fails
        for order in self.round_orders:
            if order.seq == self.status.seq:
                await self._publish(order)
        await self._reissue_platform_work()

    async def _reissue_platform_work(self) -> None:
        job = self.spec.job
        for pod, info in self.status.pod_infos.items():
            if info.inner_phase is not Phase.RESTARTING or info.finished:
                continue
            if info.evict is None:
                await self.platform.replace_pod(job, pod, info.last_failed_reason or "lost")
            else:
                await self.platform.evict_pod(job, pod, info.evict, info.last_failed_reason)

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch_heartbeats(), name=f"heartbeats:{self.spec.job}")
            group.create_task(self._resend_orders(), name=f"resend:{self.spec.job}")
            while not self.done.is_set():
                batch = [await self.queue.get()]
                while not self.queue.empty() and len(batch) < BATCH_MAX:
                    batch.append(self.queue.get_nowait())
                await self._handle_batch([item for item in batch if item is not None])
        await self.unsubscribe()
        self.events.close()

    async def unsubscribe(self) -> None:
        """Stop taking the pods' reports (idempotent; a closed connection is no error)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    @property
    def subscribed(self) -> bool:
        return self._subscription is not None

    async def _handle_batch(self, batch: list[_Platform | _Message]) -> None:
        """Step every event, persist once, then act: a status is never behind its orders."""
        changed, self._persist_due = self._persist_due, False
        done: list[tuple[_Platform | _Message, tuple[act.Action, ...]]] = []
        for item in batch:
            actions, stepped = self._step(item)
            changed |= stepped
            done.append((item, actions))
        request = self._checkpoint_request()
        if request is not None:
            self.round_orders.append(request)
            changed = True
        if changed:
            await self._persist()
            self._chaos_after_persist()
        for item, actions in done:
            await self._act(item, actions)
        if request is not None:  # after the round's own orders (a restart resets the file)
            await self._publish(request)

    def _step(self, item: _Platform | _Message) -> tuple[tuple[act.Action, ...], bool]:
        """One event logged and fed to the core; its actions, and whether the status changed."""
        now = self.clock()
        if isinstance(item, _Message):
            self.events.write(msgspec.structs.replace(item.msg, ts=now))
        else:
            self.events.write(msgspec.structs.replace(item.record, ts=now))
        before = self.status
        self.status, actions = machine.step(self.spec, before, item.event, now)
        stepped = self.status is not before
        if stepped:
            self._log_transition(before, self.status, item.event)
        slowdown = isinstance(item.event, ev.SlowdownReported)
        self._materialise_orders(actions, before.phase, slowdown)
        self._count_reschedules(actions)
        return actions, stepped

    async def _act(self, item: _Platform | _Message, actions: tuple[act.Action, ...]) -> None:
        """After the status is stored: the actions carried out, then the observers told."""
        if isinstance(item, _Message) and isinstance(item.event, ev.PodAcked):
            self.liveness.watch(item.event.pod)
        for action in actions:
            await self._execute(action)
        for msg in (item.msg,) if isinstance(item, _Message) else item.evidence:
            for on_message in self.message_listeners:
                self._observe(on_message, self, msg)
        for listener in self.listeners:
            self._observe(listener, self, item.event, actions)

    def _observe(self, listener: Callable[..., None], *args: Any) -> None:
        """An observer (metrics, fault log, live view) never stops the job: one that fails (a
        fault log on a full disk) is logged, at a bounded rate, and the loop goes on."""
        try:
            listener(*args)
        except Exception as exc:
            self.observer_failures += 1
            self._observer_log.warning("job %s: an observer failed (%d so far): %r",
                                       self.spec.job, self.observer_failures, exc)  # fmt: skip

    def _count_reschedules(self, actions: tuple[act.Action, ...]) -> None:
        """Level-3 evictions (a pod moved off a bad node), stored with the record for
        ``aegis status --nats`` (the K of the user-facing line); written with the status."""
        moved = sum(
            1 for a in actions if isinstance(a, act.EvictPod) and a.level is RecoveryLevel.NODE
        )
        if moved:
            count = int(self.extra.get("hardware_rescheduled", 0)) + moved
            self.extra["hardware_rescheduled"] = count

    def _chaos_after_persist(self) -> None:
        chaos, marker = self.settings.chaos_exit_after_persist, self.settings.chaos_marker
        if chaos and chaos == self.status.phase.value and marker and not marker.exists():
            marker.touch()
            log.error("chaos: exiting after persisting %s, before its orders", chaos)
            os._exit(137)

    def _materialise_orders(
        self, actions: tuple[act.Action, ...], before: Phase, slowdown: bool
    ) -> None:
        """The round's orders with their environment, fixed before the status is written."""
        for action in actions:
            if not isinstance(action, act.SendOrder):
                continue
            resume = None
            if action.order in TRAINING_ORDERS:
                self.safe.rewound()
                resume = self.safe.resume_step()
            scores = tie_scores(action.order, before, slowdown, self.stragglers.named)
            env = round_env(action, self.spec, self.status, self.settings.rendezvous, free_port,
                            scores=scores, resume=resume)  # fmt: skip
            order = RoundOrder(
                action.order, action.phase, action.seq, action.pods, action.exit_code, env
            )
            if self.round_orders and self.round_orders[-1].seq != action.seq:
                self.round_orders = []
            self.round_orders.append(order)

    def record(self) -> dict[str, Any]:
        record = status_json.to_dict(self.spec, self.status)
        record["orders"] = [o.to_dict() for o in self.round_orders]
        record["epoch"] = self.epoch
        record.update(self.extra)
        return record

    async def _persist(self) -> None:
        self.fence()
        payload = json.dumps(self.record()).encode()
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
            case act.SendOrder(seq=seq, order=order_kind):
                for order in self.round_orders:
                    if order.seq == seq and order.order is order_kind:
                        await self._publish(order)
                        break
            case act.EvictPod(pod=pod, level=level, exit_code=code, reason=reason):
                self.liveness.forget(pod)
                exit_order = RoundOrder(
                    Order.EXIT, self.status.phase, self.status.seq, (pod,), code
                )
                await self._publish(exit_order)
                self.fence()
                await self.platform.evict_pod(job, pod, level, reason)
            case act.ReplacePod(pod=pod, reason=reason):
                self.liveness.forget(pod)
                self.fence()
                await self.platform.replace_pod(job, pod, reason)
            case act.BlacklistNode(node=node, reason=reason):
                self.fence()
                await self.platform.blacklist_node(job, node, reason)
            case act.RecordFault(pod=pod, reason=reason, counted=counted):
                log.warning("job %s: fault of %s (%s), counted=%s", job, pod, reason, counted)
            case act.EndJob(phase=phase, reason=reason):
                log.info("job %s ended %s: %s", job, phase, reason)
                self.done.set()
                self.fence()
                await self.platform.end_job(job, phase)
            case act.Rejected(reason=reason, detail=detail):
                self.drops.add(reason.value)
                log.debug("job %s: rejected (%s: %s)", job, reason, detail)

    async def _publish(self, order: RoundOrder) -> None:
        self.fence()
        msg = m.Message(
            job=self.spec.job,
            namespace=self.spec.namespace,
            pod="master",
            type=m.MessageType.ORDER,
            phase=order.phase,
            seq=order.seq,
            ts=self.clock(),
            data=m.OrderData(order.order, list(order.pods), order.exit_code, dict(order.env)),
            epoch=self.epoch,
        )
        await self.bus.publish(self.master_subject, codec.encode_signed(msg, self.signer))

    # -- timers --------------------------------------------------------------------------------

    async def _watch_heartbeats(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while not self.done.is_set():
            await _sleep_or_done(self.done, min(0.25, timeout / 4))
            now = self.mono()
            self._drain_deadlines_passed(now)
            for pod in self.liveness.lost(now):
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
                    await self._publish(order)


def runner_from_record(record: dict[str, Any], revision: int, **kwargs: Any) -> JobRunner:
    """A runner for a job read back from the store (a takeover)."""
    spec, status = status_json.from_dict(record)
    runner = JobRunner(spec, status, revision=revision, **kwargs)
    runner.round_orders = [RoundOrder.from_dict(o) for o in record.get("orders", [])]
    kept = ("token", "nodes", "hardware_rescheduled", "committed_step", "watchdogs")
    runner.extra = {k: record[k] for k in kept if k in record}
    runner.safe.committed_step = int(record.get("committed_step", -1))
    return runner


async def _sleep_or_done(done: asyncio.Event, delay_s: float) -> None:
    try:
        await asyncio.wait_for(done.wait(), timeout=delay_s)
    except TimeoutError:
        return
