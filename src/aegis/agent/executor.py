"""The order executor: the master's orders, taken by the link, carried out on the training;
and the heartbeat, a look at the training every ``heartbeat_s`` sent through the link.

The executor drives the training through the narrow :class:`ports.Training` port (the
supervisor), one order at a time, each round at most once; what each order means is decided by
:func:`order_policy.plan`. A round of checks runs while the next order is awaited, so that an
order of a newer round can end it (:func:`order_policy.supersedes`). It answers through the
link (check results, a declined checkpoint request) and tells it when a round starts, and which
incarnation of the training (:mod:`aegis.agent.commit_rule`). The link never drives the
training, and the supervisor never sees the executor: the supervisor reports facts to the link.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aegis.adapters import aio
from aegis.agent import commit_rule, decline_rule, link, order_policy, ports, tasks
from aegis.checks import host as check_host
from aegis.checks import suites
from aegis.wire import messages as m

log = logging.getLogger(__name__)

# The progress file has no notification: looked at this often (a request declined, a new own
# save to tell).
PROGRESS_POLL_S = 0.1


class OrderExecutor:
    def __init__(
        self,
        the_link: link.MasterLink,
        training: ports.Training,
        host: check_host.CheckHost | None = None,  # warm collective checks (issue 9)
    ) -> None:
        self._link = the_link
        self._training = training
        self._host = host
        self._executed: set[tuple[int, str]] = set()
        self._background = tasks.Background()
        self._checking: tuple[int, asyncio.Task[None]] | None = None  # (seq, its check round)

    async def run(self) -> None:
        """Carry out the link's orders until the link is done (cancel to stop sooner). A round
        of checks runs while the next order is awaited: an order of a newer round ends it
        (``order_policy.supersedes``), any other waits for it; a round that fails ends the
        executor at once with its error, as an order carried out inline would."""
        try:
            while not self._link.done.done():
                msg = await self._next_order()
                assert isinstance(msg.data, m.OrderData)
                key = order_policy.round_key(msg, msg.data)
                if key in self._executed:
                    continue  # a round already executed (re-sent order): harmless
                self._executed.add(key)
                await self._settle_checks(msg.seq)
                action = order_policy.plan(msg.data.order, self._training.running)
                if action in order_policy.CHECK_ACTIONS:
                    name = f"checks-{msg.seq}"
                    task = asyncio.get_running_loop().create_task(
                        self.execute(msg, msg.data), name=name
                    )
                    self._checking = (msg.seq, task)
                else:
                    await self.execute(msg, msg.data)
        finally:
            try:
                await self._abandon_checks()
            finally:
                await self._background.close()

    async def _next_order(self) -> m.Message:
        """The link's next order; a check round that fails meanwhile raises its error here."""
        if self._checking is None:
            return await self._link.orders.get()
        checks = self._checking[1]
        order = asyncio.ensure_future(self._link.orders.get())
        try:
            await asyncio.wait({order, checks}, return_when=asyncio.FIRST_COMPLETED)
            if checks.done():
                self._checking = None
                checks.result()  # its error, if it failed
            return await order
        finally:
            if not order.done():
                order.cancel()  # (a Queue.get cancelled takes nothing off the queue)

    async def _settle_checks(self, seq: int) -> None:
        """Before the order of round ``seq``: end the check round still running when that
        order supersedes it, else let it finish (its error raises here)."""
        if self._checking is None:
            return
        (round_seq, task), self._checking = self._checking, None
        if order_policy.supersedes(round_seq, seq) and not task.done():
            log.info("checks of round %d abandoned: the order of round %d supersedes them",
                     round_seq, seq)  # fmt: skip
            task.cancel()
        since = aio.cancellations()
        try:
            await task
        except asyncio.CancelledError:
            aio.raise_if_cancelled(since)  # the executor's own stop goes on; the round's ends here

    async def _abandon_checks(self) -> None:
        """The executor ends: a check round still running is cancelled; an error it had is
        logged (the executor's own ending, a cancellation or an error, goes on)."""
        if self._checking is None:
            return
        (round_seq, task), self._checking = self._checking, None
        task.cancel()
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            log.error("checks of round %d failed: %r", round_seq, task.exception())

    async def execute(self, msg: m.Message, order: m.OrderData) -> None:
        log.info("order %s#%d", order.order, msg.seq)
        training, action = self._training, order_policy.plan(order.order, self._training.running)
        match action:
            case order_policy.Action.START | order_policy.Action.RESTART:
                self._link.begin_round(msg.phase, msg.seq)
                env = order_policy.round_env(order.env)
                restarting = action is order_policy.Action.RESTART
                count = training.restart_count + 1 if restarting else training.restart_count
                self._link.begin_incarnation(
                    commit_rule.Current(count, commit_rule.resume_step_of(env))
                )  # before the stop: a commit of the timeline it abandons is never reported
                if restarting:
                    await training.restart(env)  # AEGIS_RESTART_COUNT + 1, same agent
                else:
                    await training.start(env)
            case order_policy.Action.STOP:
                await training.stop()
            case order_policy.Action.BOOTCHECK | order_policy.Action.TROUBLESHOOT:
                troubleshoot = action is order_policy.Action.TROUBLESHOOT
                if troubleshoot:
                    await training.stop()
                results = await self._checks(order, troubleshoot)
                response = m.ChecksData(m.CheckResponse(results))
                await self._link.send(m.MessageType.FINISH, response, (msg.phase, msg.seq))
            case order_policy.Action.EXIT:
                await training.stop()
                self._link.finish(order.exit_code)
            case order_policy.Action.CHECKPOINT:
                self._request_checkpoint(msg, order_policy.checkpoint_request(msg, order))
            case order_policy.Action.NOTHING:
                ask = order_policy.checkpoint_request(msg, order)
                log.info("checkpoint request %d: no training running", ask.request)

    def _request_checkpoint(self, msg: m.Message, ask: order_policy.CheckpointRequest) -> None:
        """Hand the request to the training (through the progress file), and watch whether
        it will answer."""
        log.info("checkpoint request %d: save at step %d, hold %.0f s", ask.request,
                 ask.target_step, ask.hold_s)  # fmt: skip
        self._training.request_checkpoint(ask.request, ask.target_step, ask.hold_s)
        watch = self._decline_unless_taken(msg, ask.request)
        self._background.start(watch, f"checkpoint-request-{ask.request}")

    async def _decline_unless_taken(self, msg: m.Message, request: int) -> None:
        async def decline() -> None:
            log.warning("checkpoint request %d declined: %s", request, decline_rule.REASON)
            data = m.CheckpointDeclinedData(str(request), decline_rule.REASON)
            await self._link.send(m.MessageType.CHECKPOINT, data, (msg.phase, msg.seq))

        after_s = self._link.settings.decline_after_s
        await decline_unless_taken(self._training, after_s, decline, self._link.done.done)

    async def _checks(self, order: m.OrderData, troubleshoot: bool) -> list[m.CheckResult]:
        creds = self._link.creds
        rank, world_size = (creds.rank, creds.worker_num) if creds is not None else (None, 0)
        settings = order_policy.check_settings(
            order, self._link.settings, rank, world_size, self._link.hung, self._host
        )
        if troubleshoot:
            return await suites.troubleshoot(settings)
        return await suites.bootcheck(settings)


async def decline_unless_taken(
    training: ports.Training,
    decline_after_s: float,
    decline: Callable[[], Awaitable[None]],
    ended: Callable[[], bool],
) -> None:
    """Call ``decline`` when the training shows it will not answer a checkpoint request just
    handed to it (``decline_rule``), so the drain does not wait in vain; stop watching once
    it takes requests, stops running, or the agent ends."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = training.progress().step
    while training.running and not ended():
        seen = training.progress()
        first, verdict = decline_rule.look(first, seen, loop.time() - started, decline_after_s)
        if verdict is decline_rule.Verdict.TAKEN:
            return
        if verdict is decline_rule.Verdict.DECLINED:
            await decline()
            return
        await asyncio.sleep(PROGRESS_POLL_S)


async def beat(the_link: link.MasterLink, training: ports.Training) -> None:
    """A heartbeat every ``heartbeat_s`` until the link is done, with a look at the training
    (its last step, the watchdog's choice: ``encode.heartbeat``). A new own save of the script
    that training has gone past is told at once, after a heartbeat of its own: a drain or a
    slow pod waiting for it leaves sooner, with fewer steps done again after the save."""
    since = aio.cancellations()
    loop = asyncio.get_running_loop()
    while not the_link.done.done():
        await the_link.heartbeat(training.progress())
        due = loop.time() + the_link.settings.heartbeat_s
        while (left := due - loop.time()) > 0 and not the_link.done.done():
            try:
                await asyncio.wait_for(asyncio.shield(the_link.done), min(left, PROGRESS_POLL_S))
            except TimeoutError:
                aio.raise_if_cancelled(since)
            if the_link.untold_save(training.progress()):
                break
