"""Carries out the core's actions that reach outside the master, once the status is stored:
orders published (signed, stamped with the leader's epoch), pods evicted or replaced, nodes
blacklisted, the job ended on its platform. Every publish and platform call is fenced first
(``fence`` raises ``LeadershipLostError`` once this replica's lease is gone)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aegis.adapters.ports import Bus
from aegis.core import actions as act
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Order, Phase
from aegis.master.job_settings import Clock
from aegis.master.ports import Platform
from aegis.master.round_orders import TRAINING_ORDERS, RoundOrder
from aegis.wire import codec
from aegis.wire import messages as m


@dataclass(frozen=True, slots=True)
class Executor:
    spec: JobSpec
    bus: Bus
    platform: Platform
    subject: str  # the job's master subject, where the pods take their orders
    epoch: int
    fence: Callable[[], None]
    signer: Callable[[bytes], str] | None  # None: a server without auth, orders go unsigned
    clock: Clock
    told_committed: Callable[[], int] = lambda: -1  # the committed step stored and told

    async def publish(self, order: RoundOrder) -> None:
        if order.order in TRAINING_ORDERS and (step := self.told_committed()) >= 0:
            await self._send(order.phase, order.seq, m.CommittedData(step))  # a pod that
            # joined since it was said (a replacement, an agent restarted) hears it first too
        data = m.OrderData(order.order, list(order.pods), order.exit_code, dict(order.env))
        await self._send(order.phase, order.seq, data)

    async def tell_committed(self, status: JobStatus, step: int) -> None:
        """The job's committed step, once the record holds it (``messages.CommittedData``)."""
        await self._send(status.phase, status.seq, m.CommittedData(step))

    async def _send(self, phase: Phase, seq: int, data: m.OrderData | m.CommittedData) -> None:
        """Signed, stamped with the leader's epoch, on the job's master subject (fenced)."""
        self.fence()
        msg = m.Message(job=self.spec.job, namespace=self.spec.namespace, pod="master",
                        type=m.MessageType.ORDER, phase=phase, seq=seq, ts=self.clock(),
                        data=data, epoch=self.epoch)  # fmt: skip
        await self.bus.publish(self.subject, codec.encode_signed(msg, self.signer))

    async def publish_round(self, orders: Sequence[RoundOrder], seq: int) -> None:
        """The orders of round ``seq`` (sent again: agents ignore a round they executed)."""
        for order in orders:
            if order.seq == seq:
                await self.publish(order)

    async def end_again(self, orders: Sequence[RoundOrder], status: JobStatus) -> None:
        """A job that ended under the old leader: its last orders and its end, carried out
        again (pods and platforms take them twice)."""
        await self.publish_round(orders, status.seq)
        self.fence()
        await self.platform.end_job(self.spec.job, status.phase)

    async def execute(
        self, action: act.Action, orders: Sequence[RoundOrder], status: JobStatus
    ) -> None:
        """``orders``: the round's, with their environment; ``status``: the one just stored.
        The core's bookkeeping actions (a fault recorded, an input rejected) are the runner's."""
        job = self.spec.job
        match action:
            case act.SendOrder(seq=seq, order=kind):
                for order in orders:
                    if order.seq == seq and order.order is kind:
                        await self.publish(order)
                        break
            case act.EvictPod(pod=pod, level=level, exit_code=code, reason=reason):
                await self.publish(RoundOrder(Order.EXIT, status.phase, status.seq, (pod,), code))
                self.fence()
                await self.platform.evict_pod(job, pod, level, reason)
            case act.ReplacePod(pod=pod, reason=reason):
                self.fence()
                await self.platform.replace_pod(job, pod, reason)
            case act.BlacklistNode(node=node, reason=reason):
                self.fence()
                await self.platform.blacklist_node(job, node, reason)
            case act.EndJob(phase=phase):
                self.fence()
                await self.platform.end_job(job, phase)
            case _:
                return

    async def reissue(self, status: JobStatus) -> None:
        """A new leader: the platform work its predecessor decided and may not have done (a
        pod restarting, replaced or evicted) asked for again; platforms take it twice."""
        for pod, info in status.pod_infos.items():
            if info.inner_phase is not Phase.RESTARTING or info.finished:
                continue
            self.fence()
            if info.evict is None:
                await self.platform.replace_pod(
                    self.spec.job, pod, info.last_failed_reason or "lost"
                )
            else:
                await self.platform.evict_pod(self.spec.job, pod, info.evict,
                                              info.last_failed_reason)  # fmt: skip
