"""One job in the master: the shell around the core's ``step``.

Everything that reaches the job (agent messages from NATS, platform events) goes through one
queue (``inbox``: bad input dropped and counted) and is handled in order, in batches: log each
event to ``events.jsonl``, ``step``, then write the new status *and the round's orders* to the
store (``job_record``; revision-checked, one write per batch) *before* the ``executor`` carries
out any action; then the ``observers`` are told. Heartbeats reach the core only as
``HeartbeatLost`` and ``JoinTimedOut`` (``liveness``); checkpoints and steps through ``progress``.

High availability: every write and publish first calls ``fence()`` (``LeadershipLostError``
once the lease is gone); records and orders carry the leader's ``epoch``. A new leader builds
the runner from the stored record (``takeover``): it re-sends the round's orders, re-issues
pending platform work, restarts heartbeat timers with a grace period (``finish_end``: a job
that ended under the old leader before its end was carried out)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from aegis.adapters import aio
from aegis.adapters.aio import answers, cancellations, raise_if_cancelled, sleep_or_done
from aegis.adapters.nats_auth import job_subject_prefix, worker_subject
from aegis.adapters.ports import Bus, StatusStore, Subscription
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.errors import LocalError
from aegis.core.model import JobSpec, JobStatus, PodName
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master import inbox, job_record, node_drains
from aegis.master.drops import DropCounter, SeenIds
from aegis.master.eventlog_writer import EventLogWriter
from aegis.master.executor import Executor
from aegis.master.hang_window import HangWindow
from aegis.master.job_settings import (
    AfterPersist,
    Clocks,
    JobSettings,
    LeadershipLostError,
    no_fence,
    status_key,
)
from aegis.master.liveness import LINK_CHECK_S, Liveness
from aegis.master.observers import Observers
from aegis.master.ports import Platform
from aegis.master.progress import Progress
from aegis.master.round_orders import RoundOrder
from aegis.spawn.ports import free_port
from aegis.wire import eventlog
from aegis.wire import messages as m
from aegis.wire.logsafe import one_line

__all__ = ["Clocks", "JobRunner", "JobSettings", "LeadershipLostError", "status_key"]

log = logging.getLogger(__name__)

BATCH_MAX = 2048


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
        clocks: Clocks = Clocks(),  # noqa: B008 (frozen)
        epoch: int = 0,
        fence: Callable[[], None] = no_fence,
        notes: job_record.JobNotes | None = None,
        orders: Sequence[RoundOrder] = (),
        signer: Callable[[bytes], str] | None = None,
        after_persist: AfterPersist | None = None,
    ) -> None:
        """``notes`` and ``orders``: the stored record's (a takeover); ``signer``: signs every
        order (``Authority.sign_order``; None: a server without auth, orders go unsigned)."""
        self.spec, self.status = spec, status
        self.bus, self.store, self.platform = bus, store, platform
        self.settings, self.clocks, self.clock = settings, clocks, clocks.wall
        self.revision, self.epoch, self.fence = revision, epoch, fence
        self.notes = copy.deepcopy(notes or job_record.JobNotes())
        self.after_persist = after_persist
        prefix = job_subject_prefix(spec.namespace, spec.job, self.notes.creation)
        self.prefix, self.master_subject = prefix, f"{prefix}.master"
        self.worker_subject = worker_subject(prefix, "*")  # every pod's (one token each)
        self.events = EventLogWriter(log_dir / "events.jsonl" if log_dir else None)
        self.drops, self.seen = DropCounter(spec.job), SeenIds()
        self.queue: asyncio.Queue[inbox.Input | None] = asyncio.Queue()
        self.done = asyncio.Event()
        self.liveness = Liveness(settings.heartbeat_timeout_s, settings.join_timeout_s)
        self.round_orders: list[RoundOrder] = list(orders)
        self.progress = Progress(spec.job, settings, self.notes.committed_step)
        progress = self.progress  # its parts, for observers
        self.safe, self.pace, self.stragglers = progress.safe, progress.pace, progress.stragglers
        self._persist_due = False  # a status write wanted without an event (the straggler named)
        self._told_committed = -1  # the committed step the pods were told (once stored)
        self.hang_window = HangWindow(settings.hang_gather, status=lambda: self.status,
                                      put=self.queue.put_nowait, clock=clocks.wall,
                                      done=self.done)  # fmt: skip
        self.observers: Observers[JobRunner] = Observers(self, spec.job)
        self.listeners = self.observers.events  # the observers' lists, for ``append``
        self.message_listeners = self.observers.messages
        self.heartbeat_listeners = self.observers.heartbeats
        self.executor = Executor(spec, bus, platform, self.master_subject, epoch, fence, signer,
                                 clocks.wall, lambda: self._told_committed)  # fmt: skip
        self.task: asyncio.Task[None] | None = None  # the running loop, set by the service
        self._subscription: Subscription | None = None

    # -- inputs --------------------------------------------------------------------------------

    async def on_worker_message(self, subject: str, payload: bytes) -> None:
        """NATS callback for ``<prefix>.worker.<pod>`` (``inbox.accept``: bad input dropped)."""
        report = inbox.accept(subject, payload, self.spec, self.status, self.prefix, self.drops)
        if report is None:
            return
        pod, msg, now = report.pod, report.msg, self.clocks.mono()
        self.liveness.seen(pod, now)
        match msg.data:
            case m.CheckpointData(step=step):  # once per new step the whole job committed
                committed = self.progress.committed(self.status, pod, step, now, msg.seq)
                if committed is not None:
                    self.notes.committed_step = committed  # written at once, then told
                    self._persist_due = True
                    self.platform_event(ev.CheckpointCommitted(committed))
            case m.CheckpointDeclinedData(reason=reason):
                if (forced := self.safe.declined(self.status, pod, reason, now)) is not None:
                    self.platform_event(forced)
            case m.ScriptSavedData(step=step):  # the script's own save: slow pods may leave
                saved = self.safe.script_saved(self.status, pod, msg.seq, step, now)
                if saved is not None:
                    self.platform_event(ev.CheckpointCommitted(saved))
            case m.HealthData() as data:  # its GPUs fail soon: the node leaves, drained
                self._unhealthy(pod, data)
            case m.CheckpointStoreData() as data:  # logged, for aegis incidents and observers
                self.events.write(msgspec.structs.replace(msg, ts=self.clock()))
                self.progress.store_report(pod, data)
                self.observers.message(msg)
            case _ if report.event is None:
                self._heartbeat(pod, msg)
            case _:
                self._queue_report(msg, report.event)
        if self.progress.notes_moved():  # a save, a wait, a pace: a new leader goes on with it
            self._persist_due = True
            self.queue.put_nowait(None)  # wakes the loop: an empty batch that persists

    def _queue_report(self, msg: m.Message, event: ev.Event) -> None:
        if not self.seen.check_and_add(msg.id):
            self.drops.add("duplicate_id")
        elif not (isinstance(msg.data, m.HangData) and self.hang_window.hold(msg)):
            self.queue.put_nowait(inbox.MessageInput(msg, event))

    def _heartbeat(self, pod: PodName, msg: m.Message) -> None:
        """A heartbeat: the step it carries, the pod's watchdog (kept for ``aegis status``)."""
        beat = msg.data
        if isinstance(beat, m.HeartbeatData) and beat.step is not None:
            stepped = self.progress.step_seen(self.status, pod, msg.seq, beat, self.clocks.mono())
            self.notes.stragglers = self.stragglers.summary  # for ``aegis status``
            if stepped.named_changed:  # written at once when the pod named changes
                self._persist_due = True
                self.queue.put_nowait(None)  # wakes the loop: an empty batch that persists
            if stepped.slowdown is not None:
                self.platform_event(ev.SlowdownReported(stepped.slowdown))
        if self.safe.due(self.status):  # a request waits for this round's steps (or a while)
            self.queue.put_nowait(None)  # wakes the loop: an empty batch that places it
        if isinstance(beat, m.HeartbeatData) and beat.hang_timeout:
            self.notes.watchdogs[pod] = beat.hang_timeout[:300]
        self.hang_window.beat(msg)
        self.observers.heartbeat(msg)

    def hang_named(self, pod: PodName, reason: str) -> None:
        """A hang of ``pod`` named from outside (``aegis ctl hang``): no window, it is blamed."""
        self.queue.put_nowait(inbox.operator_hang(pod, reason, self.status, self.clock()))

    def drain(self, pods: tuple[PodName, ...], reason: str, deadline_s: float) -> None:
        """``aegis ctl drain``: these pods leave at the next committed checkpoint (requested
        now), or after ``deadline_s`` without one; no fault is counted."""
        self.safe.drain(pods, deadline_s, self.clocks.mono())
        self.platform_event(ev.DrainRequested(pods, reason))

    def _unhealthy(self, pod: PodName, data: m.HealthData) -> None:
        if node_drains.names_another_node(self.status, pod, data):
            self.drops.add("health_other_node", f"{pod} names {data.node!r}, placed elsewhere")
        elif (found := node_drains.health_drain(self.status, pod, data)) is not None:
            log.warning("job %s: %s: the pods there leave", self.spec.job, found.reason)
            self.platform_event(ev.NodeDown(found.node, found.reason))  # kept out, no count
            self.drain(found.pods, found.reason, self.settings.drain_deadline_s)

    def platform_event(self, event: ev.Event) -> None:
        record = inbox.platform_record(event, self.clock())
        if isinstance(event, ev.PodRestarted):
            self.liveness.seen(event.pod, self.clocks.mono())
            self.liveness.forget(event.pod, self.clocks.mono())
        self.queue.put_nowait(inbox.PlatformInput(event, record))

    def pod_nodes(self) -> dict[PodName, str]:
        return {pod: info.node for pod, info in self.status.pod_infos.items()}

    async def wait_done(self) -> None:
        """Until the job is over; raises ``LocalError`` when the job's loop died first."""
        if not await aio.until_set_or_failed(self.done, self.task):
            error = self.task.exception() if self.task and self.task.done() else None
            raise LocalError(f"job {self.spec.job}: its loop ended early: {error!r}") from error

    def close(self) -> None:  # the loop (and its timers) stopped without an event
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
        now, status = self.clocks.mono(), self.status
        self.liveness.taken_over(status, now)
        self.progress.taken_over(status, self.round_orders, self.settings.drain_deadline_s,
                                 self.notes, now, self.clock())  # fmt: skip
        await self._persist()  # claims every job key for this epoch: a deposed leader's
        # next revision-checked write fails
        await self.executor.publish_round(self.round_orders, status.seq)
        await self.executor.reissue(status)

    async def finish_end(self) -> None:
        """A job that ended under the old leader, which may have died before carrying the end
        out: the last round's orders sent again, the platform told, the end marked done."""
        await self.executor.end_again(self.round_orders, self.status)
        self.notes.end_pending = False
        await self._persist()

    # -- the loop ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until the job ends, ``close`` or a cancellation. A cancellation that a write or a
        publish swallowed (nats-py's replies on Python 3.11, see ``adapters.aio``) still stops
        the loop at its next turn: a CI run's master kept deciding after its service closed."""
        since = cancellations()
        async with asyncio.TaskGroup() as group:
            group.create_task(self._watch_heartbeats(), name=f"heartbeats:{self.spec.job}")
            group.create_task(self._resend_orders(), name=f"resend:{self.spec.job}")
            while not self.done.is_set():
                raise_if_cancelled(since)
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

    async def _handle_batch(self, batch: list[inbox.Input]) -> None:
        """Step every event, persist once, then act: a status is never behind its orders."""
        changed, self._persist_due = self._persist_due, False
        done: list[tuple[inbox.Input, tuple[act.Action, ...]]] = []
        for item in batch:
            actions, stepped = self._step(item)
            changed |= stepped
            done.append((item, actions))
        request = self.progress.checkpoint_request(self.status, self.clocks.mono())
        if request is not None:
            self.round_orders.append(request)
            changed = True
        if changed:
            await self._persist()
            if self.after_persist is not None:
                self.after_persist(self.status)
        for item, actions in done:
            await self._act(item, actions)
        if request is not None:  # after the round's own orders (a restart resets the file)
            await self.executor.publish(request)
        if self.notes.end_pending:  # the end carried out: no new leader does it again
            self.notes.end_pending = False
            await self._persist()

    def _step(self, item: inbox.Input) -> tuple[tuple[act.Action, ...], bool]:
        """One event logged and fed to the core; its actions, and whether the status changed."""
        now = self.clock()
        if isinstance(item, inbox.MessageInput):
            self.events.write(msgspec.structs.replace(item.msg, ts=now))
        else:
            self.events.write(msgspec.structs.replace(item.record, ts=now))
        before = self.status
        self.status, actions = machine.step(self.spec, before, item.event, now)
        if self.status is not before and before.phase is not self.status.phase:
            log.info("job %s: %s -> %s on %s (recover_count %d)", self.spec.job, before.phase,
                     self.status.phase, type(item.event).__name__,
                     self.status.recover_count)  # fmt: skip
        slowdown = isinstance(item.event, ev.SlowdownReported)
        self.round_orders = self.progress.orders_after(actions, self.round_orders, self.spec,
                                                       self.status, free_port, before.phase,
                                                       slowdown)  # fmt: skip
        moved = sum(isinstance(a, act.EvictPod) and a.level is RecoveryLevel.NODE for a in actions)
        self.notes.hardware_rescheduled += moved  # the K of ``aegis status --nats``
        for action in actions:
            if isinstance(action, act.EndJob):  # why, in the status write that ends the job
                self.notes.ended, self.notes.end_pending = action.reason, True
        return actions, self.status is not before

    async def _act(self, item: inbox.Input, actions: tuple[act.Action, ...]) -> None:
        """After the status is stored: the actions carried out, then the observers told."""
        if isinstance(item.event, ev.PodAcked) and not any(
            isinstance(a, act.Rejected) for a in actions
        ):
            self.liveness.watch(item.event.pod)  # accepted: back (a refused ACK is no return)
        for action in actions:
            self._account(action)
            await self.executor.execute(action, self.round_orders, self.status)
        for msg in (item.msg,) if isinstance(item, inbox.MessageInput) else item.evidence:
            self.observers.message(msg)
        self.observers.event(item.event, actions)

    def _account(self, action: act.Action) -> None:
        """The runner's own part of an action, before the executor's: the heartbeat watch,
        the log, the drop counts, the end."""
        job = self.spec.job
        match action:
            case act.EvictPod(pod=pod) | act.ReplacePod(pod=pod):
                self.liveness.forget(pod, self.clocks.mono())
            case act.RecordFault(pod=pod, reason=reason, counted=counted):
                log.warning("job %s: fault of %s (%s), counted=%s", job, pod, one_line(reason),
                            counted)  # fmt: skip
            case act.EndJob(phase=phase, reason=reason):
                log.info("job %s ended %s: %s", job, phase, reason)
                self.done.set()
            case act.Rejected(reason=reason, detail=detail):
                self.drops.add(reason.value)
                log.debug("job %s: rejected (%s: %s)", job, reason, detail)

    def record(self) -> job_record.JobRecord:
        """What the store keeps of the job (``job_record``)."""
        self.progress.note(self.notes, self.clocks.mono(), self.clock())
        return job_record.build(self.spec, self.status, self.notes, self.round_orders, self.epoch)

    async def _persist(self) -> None:
        self.fence()
        committed = self.notes.committed_step
        self.revision = await self.store.put(status_key(self.spec),
                                             job_record.encode(self.record()),
                                             expected_revision=self.revision)  # fmt: skip
        if committed > self._told_committed:  # stored: the pods' savers keep it from now on
            await self.executor.tell_committed(self.status, committed)  # (a new leader: again)
            self._told_committed = committed

    # -- timers --------------------------------------------------------------------------------

    async def _watch_heartbeats(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        while not self.done.is_set():
            await sleep_or_done(self.done, min(0.25, timeout / 4))
            now = self.clocks.mono()
            for forced in self.safe.deadlines_passed(self.status, now):
                self.platform_event(forced)
            due = self.liveness.due(now)  # could it have heard the pods it would judge silent?
            heard = self.bus.connected and (not due or await answers(self.bus, LINK_CHECK_S))
            asked, now = now, self.clocks.mono()  # (a slow answer: the bus was hung till now)
            if not self.liveness.hearing(heard, now, self.spec.job, answered_s=now - asked):
                continue  # the master's own link is down: a silence says nothing
            for event in self.liveness.overdue(now):  # a pod silent, or not back in time
                said = getattr(event, "reason", f"silent for {timeout:.1f} s")
                log.warning("job %s: %s %s", self.spec.job, event.pod, said)
                self.platform_event(event)

    async def _resend_orders(self) -> None:
        """Orders travel at most once on NATS core: re-send the current round's orders while
        pods have not answered (agents ignore a round they already executed)."""
        while not self.done.is_set():
            await sleep_or_done(self.done, self.settings.order_resend_s)
            if self.done.is_set() or self.status.phase in TERMINAL_PHASES:
                return
            if self.status.outstanding == 0 or self.status.phase is Phase.RESTARTING:
                continue
            await self.executor.publish_round(self.round_orders, self.status.seq)
