"""The agent's link to the master: reports out, orders in, over :mod:`aegis.agent.transport`.

``MasterLink`` is the supervisor's ``AgentReports`` port (exits, a dying process, hangs) and the
saver daemon's (commits, store outages): it turns what they report into Finish/Error/Hang/
Checkpoint messages (:mod:`aegis.agent.encode`) on ``<prefix>.worker.<pod>``, and sends a
report again, same id, until a newer round shows it was heard. It takes the master's orders
into ``orders`` (what it takes is :mod:`aegis.agent.order_policy`'s: signed, of this job, of
the current master, for this pod, with only the environment keys orders carry); whatever it
drops is counted (``dropped``, ``dropped_env``) and logged at a bounded rate.

A commit of the saver daemon is reported unless it is of the timeline a restart abandoned (an
older incarnation's, past the step the current one resumed from: :mod:`aegis.agent.commit_rule`).

It never reads nor drives the training: the supervisor reports facts to it, and the order
executor (:mod:`aegis.agent.executor`) carries out its orders, tells it when a round starts
(:meth:`begin_round`) and which incarnation of the training it starts
(:meth:`begin_incarnation`), and hands it each heartbeat's look at the training.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable

from aegis.adapters import aio
from aegis.adapters.grpc import creds as grpc_creds
from aegis.agent import commit_rule, encode, link_settings, order_policy, ports, transport
from aegis.checkpoint import outage
from aegis.core.phases import Phase
from aegis.wire import messages as m
from aegis.wire.logsafe import RateLimitedLog, shown

log = logging.getLogger(__name__)

Round = tuple[Phase, int]


class MasterLink:
    def __init__(self, settings: link_settings.LinkSettings) -> None:
        self.settings = settings
        self.incarnation = secrets.token_hex(4)
        self._sender = encode.Sender(settings.job, settings.namespace, settings.pod,
                                     self.incarnation)  # fmt: skip
        self._ids = itertools.count()
        self.orders: asyncio.Queue[m.Message] = asyncio.Queue()
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.transport = transport.Transport(
            settings, self.receive, self._connected, ended=self.done.done
        )
        self.run_round: Round = (Phase.RUN_COMMAND, -1)
        self.hung = False  # a hang was reported in the current round
        self.current = commit_rule.Current()  # the training's incarnation, as ordered
        # (pid, restart count) of incarnations whose fault went ahead of their exit
        self._dying_reported: set[tuple[int, int]] = set()
        self._beats, self._watchdog_said = 0, ""
        self._saved_said: int | None = None  # the script's own save the last report told
        self.max_epoch = 0
        self.pending: list[m.Message] = []  # reports not yet answered by a newer round
        self.dropped: Counter[str] = Counter()  # orders dropped, by reason
        self.dropped_env: Counter[str] = Counter()  # environment keys dropped from orders
        self._drop_log = RateLimitedLog(log)
        # the job's committed step, as the master tells it, for the saver: it keeps that step
        # and the newest after it (``process.hold_from``; set by the agent when it runs one)
        self.hold_from: Callable[[int], None] = lambda step: None

    @property
    def creds(self) -> grpc_creds.WorkerCreds | None:
        return self.transport.creds

    async def connect(self) -> None:
        """Credentials, NATS, the orders' subscription, an ACK (``LinkUnavailableError`` when
        neither the master nor NATS answers; a refusal raises ``CredsRefusedError``)."""
        await self.transport.connect()

    async def _connected(self) -> None:
        address = transport.pod_address(os.environ, self.settings.grpc_target)
        ack = m.AckData(self.settings.node, address, self.incarnation)
        await self.send(m.MessageType.ACK, ack, (Phase.PENDING, 0))

    def env(self) -> dict[str, str]:
        """The environment of the training command: torchrun's and Kubeflow's variables."""
        assert self.creds is not None
        return link_settings.training_env(self.settings, self.creds.rank, self.creds.worker_num)

    async def close(self) -> None:
        await self.transport.close()

    # -- rounds (the order executor's) ---------------------------------------------------------

    def begin_round(self, phase: Phase, seq: int) -> None:
        """A run or restart order started round (phase, seq): later reports are of it."""
        self.run_round = (phase, seq)
        self.hung = False

    def begin_incarnation(self, current: commit_rule.Current) -> None:
        """The training is (re)started as ``current``: the saver's commits of the timeline it
        abandons are no longer reported (:func:`commit_rule.abandoned`)."""
        self.current = current

    def finish(self, exit_code: int) -> None:
        """The agent ends with ``exit_code`` (the master's exit order, or a SIGTERM)."""
        if not self.done.done():
            self.done.set_result(exit_code)

    # -- reports (the supervisor's port, the saver's callbacks) --------------------------------

    async def child_exited(self, report: ports.ExitReport) -> None:
        incarnation = (report.pid, report.restart_count)
        reported = incarnation in self._dying_reported
        self._dying_reported.discard(incarnation)
        said = encode.exited(report, reported)
        if said is not None:
            await self.send(*said)

    async def child_dying(self, report: ports.DyingReport) -> None:
        """The training process is exiting on an uncaught exception: report the fault now (the
        master's round begins while the interpreter finishes; its order stops what is left)."""
        self._dying_reported.add((report.pid, report.restart_count))
        await self.send(m.MessageType.ERROR, encode.dying(report))

    async def hang_detected(self, report: ports.HangReport) -> None:
        self.hung = True
        await self.send(m.MessageType.HANG, encode.hang(report))

    async def fault_seen(self, report: ports.FaultReport) -> None:
        log.info("fault signature %s: %s", report.match.fault_class, report.match.line)

    async def checkpoint_committed(self, step: int, incarnation: int = -1) -> None:
        """The saver daemon committed ``step``, saved by ``incarnation`` (-1: not known): the
        master's safe point for evictions, unless a restart abandoned its timeline."""
        if commit_rule.abandoned(step, incarnation, self.current):
            log.info("commit of step %d not reported: saved by incarnation %d, of the timeline "
                     "abandoned when incarnation %d resumed from step %s", step, incarnation,
                     self.current.restart_count, self.current.resume_step)  # fmt: skip
            return
        await self.send(m.MessageType.CHECKPOINT, m.CheckpointData(step))

    async def checkpoint_store(self, report: outage.StoreReport) -> None:
        """The saver daemon cannot persist (or can again): the master logs and counts it."""
        await self.send(m.MessageType.CHECKPOINT, report)

    async def unhealthy(self, warnings: list[str]) -> None:
        """The node's GPUs show warning signs (``agent.health``): the master drains it."""
        await self.send(m.MessageType.CHECKPOINT, m.HealthData(warnings, self.settings.node))

    async def heartbeat(self, progress: ports.Progress) -> None:
        """One heartbeat with this look at the training. A hang reported in this round that is
        over (the beat tells the master so: it withdraws the report) is no longer resent: a new
        leader would hold it with no beat left to withdraw it."""
        if self.hung and not progress.hung:
            self.hung, self.pending = False, encode.without_hangs(self.pending)
        data = encode.heartbeat(progress, self._watchdog_said, self._beats, time.monotonic())
        saved = encode.script_saved(progress, self._saved_said, self._beats)
        self._watchdog_said, self._beats = progress.hang_timeout, self._beats + 1
        await self.send(m.MessageType.HEARTBEAT, data)
        if saved is not None:  # after the beat: the master knows the step it is behind
            self._saved_said = saved.step
            await self.send(m.MessageType.CHECKPOINT, saved)

    def untold_save(self, progress: ports.Progress) -> bool:
        """Whether ``progress`` shows an own save of the script no report has told yet."""
        return progress.saved_step is not None and progress.saved_step != self._saved_said

    async def send(self, kind: m.MessageType, data: m.Payload, round_: Round | None = None) -> None:
        """Report ``data`` for ``round_`` (the current round by default); kept for the resend
        unless a newer report supersedes it (``encode.resent``). Nothing before connecting."""
        if not self.transport.connected:
            return
        msg = encode.message(self._sender, next(self._ids), kind, round_ or self.run_round,
                             data, time.time())  # fmt: skip
        if encode.resent(kind):
            self.pending.append(msg)
        await self.transport.publish(msg)

    async def resend(self) -> None:
        """Reports that may have reached no master (a failover) go again, same id, until a
        newer round shows they were heard; the master counts each at most once."""
        since = aio.cancellations()
        while not self.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.done), self.settings.resend_s)
            except TimeoutError:
                aio.raise_if_cancelled(since)
                if self.transport.connected:
                    for msg in list(self.pending):
                        await self.transport.publish(msg)

    # -- orders --------------------------------------------------------------------------------

    async def receive(self, payload: bytes) -> None:
        """A payload on the master subject: an order for this pod goes into ``orders``."""
        s = self.settings
        screened = order_policy.screen(payload, self.transport.verify, s.job, s.namespace)
        if isinstance(screened, order_policy.Dropped):
            self._drop(screened.reason, screened.detail)
            return
        msg = screened.msg
        if screened.dropped_env:
            self._drop_env(msg, screened.dropped_env)
        assert isinstance(msg.data, m.OrderData | m.CommittedData)
        if not m.current_epoch(msg.epoch, self.max_epoch):
            log.warning(
                "ignored an order of a deposed master (epoch %d < %d)", msg.epoch, self.max_epoch
            )
            return
        self.max_epoch = msg.epoch
        if (held := order_policy.held_step(msg.data)) is not None:
            self.hold_from(held)
        if isinstance(msg.data, m.CommittedData):
            return
        self.pending = encode.unanswered(self.pending, msg.seq)
        if order_policy.for_pod(msg.data, s.pod):
            self.orders.put_nowait(msg)

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        self._drop_log.warning("dropped an order (%s: %s; %d in all)", reason,
                               shown(detail, 200), sum(self.dropped.values()))  # fmt: skip

    def _drop_env(self, msg: m.Message, unknown: tuple[str, ...]) -> None:
        assert isinstance(msg.data, m.OrderData)
        for key in unknown:
            self.dropped_env[order_policy.counted_as(key, self.dropped_env)] += 1
        self._drop_log.warning(
            "dropped environment key(s) %s of order %s#%d (not a key orders carry; %d in all)",
            ", ".join(shown(k) for k in unknown[:5]), msg.data.order, msg.seq,
            sum(self.dropped_env.values()),
        )  # fmt: skip
