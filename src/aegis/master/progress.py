"""A job's training progress, as the master follows it (no I/O; times are the caller's
monotonic ``now``): the checkpoints every pod committed and the checkpoint requests
(``safe_points``), the pace watch (``pace.Pace``) and the straggler scores
(``pace.StragglerWatch``); and what of it a round's orders carry (the step to resume from, the
scores of a slowdown's troubleshooting round).

Each method returns what the runner is to do: an event for the core, a status write, an order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aegis.core import actions as act
from aegis.core.model import JobSpec, JobStatus, PodName
from aegis.core.phases import Order, Phase
from aegis.master import round_orders, safe_point_notes
from aegis.master.job_record import JobNotes
from aegis.master.job_settings import JobSettings
from aegis.master.pace import Pace, StragglerWatch
from aegis.master.round_orders import RoundOrder
from aegis.master.safe_points import RequestSettings, SafePoints
from aegis.wire import messages as m
from aegis.wire.logsafe import one_line

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Stepped:
    """What a heartbeat's training step told: a slowdown (its reason; None: none), and whether
    the straggler named changed (the record is written at once)."""

    slowdown: str | None = None
    named_changed: bool = False


class Progress:
    def __init__(self, job: str, settings: JobSettings, committed_step: int = -1) -> None:
        requests = RequestSettings(settings.checkpoint_on_slow, settings.checkpoint_lead_s,
                                   settings.checkpoint_hold_s)  # fmt: skip
        self.job, self.rule = job, settings.rendezvous
        self.safe = SafePoints(job, requests, committed_step=committed_step)
        self.pace = Pace(settings.pace)
        self.stragglers = StragglerWatch(settings.stragglers)
        self._noted = self._key()

    def note(self, into: JobNotes, now: float, wall: float) -> None:
        """The safe points' and the pace watch's notes for a new leader, written ``into`` the
        notes a record write carries."""
        self._noted = self._key()
        into.safe_points = safe_point_notes.note(self.safe, now, wall)
        into.pace = self.pace.notes()

    def _key(self) -> tuple[object, ...]:
        return safe_point_notes.key(self.safe), self.pace.notes_key()

    def taken_over(
        self,
        status: JobStatus,
        orders: Sequence[RoundOrder],
        deadline_s: float,
        notes: JobNotes,
        now: float,
        wall: float,
    ) -> None:
        """A new leader's: the round's checkpoint request still pending, the old leader's
        cadence and waits and its pace watch (its ``notes``) restored."""
        requested = any(o.order is Order.CHECKPOINT and o.seq == status.seq for o in orders)
        self.safe.taken_over(status, requested, deadline_s, now)
        trained = [o.seq for o in orders if o.order in round_orders.TRAINING_ORDERS]
        self.safe.rewound_seq = max(trained, default=-1)  # the round training restarted in
        if notes.safe_points is not None:
            safe_point_notes.restore(self.safe, notes.safe_points, status, now, wall)
        if notes.pace is not None:
            self.pace.restore(notes.pace)

    def notes_moved(self) -> bool:
        """Whether the notes changed since the record was last written (a save, a wait for one
        began or ended, a round's pace measured or reported): it is then written at once."""
        return self._key() != self._noted

    def store_report(self, pod: PodName, data: m.CheckpointStoreData) -> None:
        """A pod's durable checkpoint directory fails (logged once per outage) or works again."""
        if data.opened:
            log.error("job %s pod %s: checkpoint store %s down: [Errno %d] %s; step %d kept in "
                      "memory, training goes on", self.job, pod, one_line(data.directory, 200),
                      data.errno, one_line(data.strerror, 200), data.step)  # fmt: skip
        elif data.ok:
            log.warning("job %s pod %s: checkpoint store %s back after %.1f s", self.job,
                        pod, one_line(data.directory, 200), data.down_s)  # fmt: skip

    def committed(
        self, status: JobStatus, pod: PodName, step: int, now: float, seq: int = -1
    ) -> int | None:
        """``pod`` committed ``step`` (said in round ``seq``): the job's new committed step,
        once per new step every pod committed (None: no new one)."""
        committed = self.safe.committed(status, pod, step, now, seq)
        if committed is not None:
            self.pace.committed()
        return committed

    def step_seen(
        self, status: JobStatus, pod: PodName, seq: int, beat: m.HeartbeatData, now: float
    ) -> Stepped:
        """A heartbeat's training step (``beat.step`` set)."""
        step = beat.step
        assert step is not None
        self.safe.step_seen(status, pod, seq, step, now)
        if seq != status.seq or status.phase is not Phase.RUN_COMMAND:
            return Stepped()
        changed = False
        if beat.step_ts is not None and beat.sent_mono is not None:
            self.stragglers.step_seen(
                seq, pod, step, beat.step_ts, beat.sent_mono, now, beat.input_s
            )
            changed = self.stragglers.take_named_change()
        if seq != self.pace.seq:
            self.pace.round_started(seq, frozenset((str(p), i.node) for p, i in
                                                   status.pod_infos.items()))  # fmt: skip
        slowed = self.pace.step_seen(seq, pod, step, now)
        if slowed is not None:
            nodes = {pod: info.node for pod, info in status.pod_infos.items()}
            slowed += self.stragglers.naming(nodes)
            log.warning("job %s: training slowed down: %s", self.job, slowed)
        return Stepped(slowed, changed)

    def checkpoint_request(self, status: JobStatus, now: float) -> RoundOrder | None:
        """The checkpoint order of this round, when a pod waits to leave at a checkpoint."""
        env = self.safe.request(status, now)
        if env is None:
            return None
        return RoundOrder(Order.CHECKPOINT, status.phase, status.seq, (), 0, env)

    def orders_after(
        self,
        actions: Sequence[act.Action],
        orders: Sequence[RoundOrder],
        spec: JobSpec,
        status: JobStatus,
        free_port: Callable[[], int],
        before: Phase,
        slowdown: bool,
    ) -> list[RoundOrder]:
        """The round's orders once ``actions`` are taken: each order sent, with its
        environment (``round_order``), fixed before the status is written: ``orders`` (left
        unchanged) and this round's new ones, or only the new ones when a new round began."""
        for action in actions:
            if isinstance(action, act.SendOrder):
                order = self.round_order(action, spec, status, free_port, before, slowdown)
                same_round = [o for o in orders if o.seq == action.seq]
                orders = [*same_round, order]  # a new list: the one given is left as it was
        return list(orders)

    def round_order(
        self,
        order: act.SendOrder,
        spec: JobSpec,
        status: JobStatus,
        free_port: Callable[[], int],
        before: Phase,
        slowdown: bool,
    ) -> RoundOrder:
        """``order`` with its environment (``round_orders.round_env``): a training round
        resumes from the committed step (what was committed beyond it is forgotten), a
        slowdown's troubleshooting round carries the straggler named."""
        resume = None
        if order.order in round_orders.TRAINING_ORDERS:
            self.safe.rewound(order.seq)
            resume = self.safe.resume_step()
        scores: Mapping[str, float] = round_orders.tie_scores(
            order.order, before, slowdown, self.stragglers.named
        )
        env = round_orders.round_env(order, spec, status, self.rule, free_port,
                                     scores=scores, resume=resume)  # fmt: skip
        return RoundOrder(order.order, order.phase, order.seq, order.pods, order.exit_code, env)
