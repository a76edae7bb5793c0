"""The master's orders on the agent: the pure policies (which order is taken, what it means)
and the executor that carries them out on the training (a fake one here)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pytest

from aegis.agent import executor, link, link_settings, order_policy, ports
from aegis.core.phases import Order, Phase
from aegis.wire import codec
from aegis.wire import messages as m
from tests.waits import async_wait_until

SETTINGS = link_settings.LinkSettings("127.0.0.1:1", "ns", "job", "job-1", "t")


def _order(
    order: Order, seq: int = 3, env: Mapping[str, str] | None = None, **kw: object
) -> m.Message:
    data = m.OrderData(order, env=dict(env or {}), **kw)  # type: ignore[arg-type]
    return m.Message(job="job", namespace="ns", pod="master", type=m.MessageType.ORDER,
                     phase=Phase.RUN_COMMAND, seq=seq, ts=1.0, data=data)  # fmt: skip


def _screen(msg: m.Message | bytes, verify: order_policy.Verify | None = None) -> object:
    payload = msg if isinstance(msg, bytes) else codec.encode(msg)
    return order_policy.screen(payload, verify, "job", "ns")


def test_an_order_is_taken_only_decoded_signed_and_of_this_job() -> None:
    run = _order(Order.RUN)
    assert _screen(run) == order_policy.Accepted(run)
    assert _screen(run, verify=lambda body, sig: sig == "good") == order_policy.Dropped(
        "unsigned", "run#3 epoch 0"
    )
    other = msgspec.structs.replace(run, job="other")
    assert _screen(other) == order_policy.Dropped("wrong_job", "an order of ns/other")
    report = m.Message(job="job", namespace="ns", pod="job-0", type=m.MessageType.FINISH,
                       phase=Phase.RUN_COMMAND, seq=3, ts=1.0, data=m.ExitData(0))  # fmt: skip
    dropped = _screen(report)
    assert isinstance(dropped, order_policy.Dropped) and dropped.reason == "not_an_order"
    garbage = _screen(b"{not json")
    assert isinstance(garbage, order_policy.Dropped) and garbage.reason != "not_an_order"


def test_an_order_keeps_only_the_environment_keys_orders_carry_and_names_the_others() -> None:
    env = {"MASTER_PORT": "5", "LD_PRELOAD": "/x.so", "BASH_ENV": "/y"}
    taken = _screen(_order(Order.RUN, env=env))
    assert isinstance(taken, order_policy.Accepted)
    assert isinstance(taken.msg.data, m.OrderData) and taken.msg.data.env == {"MASTER_PORT": "5"}
    assert taken.dropped_env == ("BASH_ENV", "LD_PRELOAD")


@pytest.mark.parametrize(
    ("key", "text"),
    [
        (m.CKPT_STEP_ENV, "ten"),
        (m.CKPT_REQUEST_ENV, "1.5"),
        (m.RESUME_STEP_ENV, ""),
        (m.CKPT_HOLD_ENV, "nan"),
        (m.CKPT_HOLD_ENV, "inf"),
        (m.CKPT_HOLD_ENV, "-1"),
        ("CHECK_MASTER_PORT", "x"),
        ("MASTER_PORT", "70000"),
        ("MASTER_PORT", "9" * 5000),
    ],
)
def test_an_order_with_a_number_the_agent_cannot_read_is_dropped_and_counted(
    key: str, text: str
) -> None:
    """The agent reads these numbers itself (a checkpoint request, the checks' port): one that
    is not a number of its kind drops the order, where it crashed the agent (and its training)."""
    dropped = _screen(_order(Order.CHECKPOINT, env={key: text}))
    assert isinstance(dropped, order_policy.Dropped) and dropped.reason == "bad_env"
    assert key in dropped.detail
    fine = {m.CKPT_STEP_ENV: "10", m.CKPT_HOLD_ENV: "2.5", "CHECK_MASTER_PORT": "29400"}
    assert isinstance(_screen(_order(Order.CHECKPOINT, env=fine)), order_policy.Accepted)


def test_dropped_names_are_counted_by_name_while_few_then_together() -> None:
    assert order_policy.counted_as("EVIL", {}) == "EVIL"
    assert order_policy.counted_as("X" * 100, {}) == "X" * 64
    many = {f"K{i}": 1 for i in range(64)}
    assert order_policy.counted_as("K3", many) == "K3"  # a name already counted
    assert order_policy.counted_as("NEW", many) == "(others)"
    assert order_policy.counted_as("", {}) == "(others)"


def _committed(step: int, epoch: int = 0) -> m.Message:
    return m.Message(job="job", namespace="ns", pod="master", type=m.MessageType.ORDER,
                     phase=Phase.RUN_COMMAND, seq=3, ts=1.0, data=m.CommittedData(step),
                     epoch=epoch)  # fmt: skip


def test_the_word_of_a_committed_step_is_taken_as_an_order_is() -> None:
    word = _committed(40)
    assert _screen(word) == order_policy.Accepted(word)
    assert _screen(word, verify=lambda body, sig: sig == "good") == order_policy.Dropped(
        "unsigned", "committed#3 epoch 0"
    )
    other = msgspec.structs.replace(word, namespace="elsewhere")
    assert _screen(other) == order_policy.Dropped("wrong_job", "an order of elsewhere/job")
    negative = codec.encode(word).replace(b'"step":40', b'"step":-1')
    dropped = _screen(negative)
    assert isinstance(dropped, order_policy.Dropped) and dropped.reason != "not_an_order"


def test_the_saver_keeps_the_steps_from_the_committed_one_the_master_told() -> None:
    assert order_policy.held_step(m.CommittedData(40)) == 40
    # a round's resume step is not a word of the committed step: a master that never tells it
    # sends one too, and the saver would keep every step after it for the whole run
    assert order_policy.held_step(m.OrderData(Order.RUN, env={m.RESUME_STEP_ENV: "35"})) is None
    assert order_policy.held_step(m.OrderData(Order.CHECKPOINT)) is None


async def test_the_link_tells_the_saver_the_committed_step_of_its_masters_term_only() -> None:
    the_link = link.MasterLink(SETTINGS)
    held: list[int] = []
    the_link.hold_from = held.append
    await the_link.receive(codec.encode(_committed(40, epoch=5)))
    await the_link.receive(codec.encode(_order(Order.RUN, 4, {m.RESUME_STEP_ENV: "40"})))
    await the_link.receive(codec.encode(_committed(10, epoch=4)))  # a deposed master's word
    await the_link.receive(codec.encode(_committed(50, epoch=5)))
    assert held == [40, 50] and the_link.orders.qsize() == 0  # the order was of epoch 0
    await the_link.receive(codec.encode(msgspec.structs.replace(
        _order(Order.RUN, 6, {m.RESUME_STEP_ENV: "30"}), epoch=5)))  # fmt: skip
    assert held == [40, 50] and the_link.orders.qsize() == 1  # a word is no order, nor back
    await the_link.close()


def test_an_order_of_a_deposed_master_or_for_other_pods_is_not_taken() -> None:
    assert m.current_epoch(epoch=4, newest=4) and not m.current_epoch(3, 4)
    assert order_policy.for_pod(m.OrderData(Order.RUN), "job-1")
    assert order_policy.for_pod(m.OrderData(Order.RUN, pods=["job-1"]), "job-1")
    assert not order_policy.for_pod(m.OrderData(Order.RUN, pods=["job-0"]), "job-1")


def test_a_round_is_its_seq_and_order_and_a_checkpoint_requests_id() -> None:
    def key(msg: m.Message) -> tuple[int, str]:
        assert isinstance(msg.data, m.OrderData)
        return order_policy.round_key(msg, msg.data)

    assert key(_order(Order.RUN, 3)) == key(_order(Order.RUN, 3)) != key(_order(Order.RUN, 4))
    first = _order(Order.CHECKPOINT, 3, {m.CKPT_REQUEST_ENV: "3"})
    second = _order(Order.CHECKPOINT, 3, {m.CKPT_REQUEST_ENV: "4"})
    assert key(first) != key(second)


@pytest.mark.parametrize(
    ("order", "running", "action"),
    [
        (Order.RUN, False, order_policy.Action.START),
        (Order.RUN, True, order_policy.Action.RESTART),  # a new round: in place
        (Order.RESTART, False, order_policy.Action.RESTART),
        (Order.STOP, True, order_policy.Action.STOP),
        (Order.BOOTCHECK, False, order_policy.Action.BOOTCHECK),
        (Order.TROUBLESHOOT, True, order_policy.Action.TROUBLESHOOT),
        (Order.EXIT, True, order_policy.Action.EXIT),
        (Order.CHECKPOINT, False, order_policy.Action.NOTHING),  # no training running
        (Order.CHECKPOINT, True, order_policy.Action.CHECKPOINT),
    ],
)
def test_plan_says_what_each_order_asks_of_the_training(
    order: Order, running: bool, action: order_policy.Action
) -> None:
    assert order_policy.plan(order, running) is action


def test_a_checkpoint_order_names_its_request_step_and_hold() -> None:
    env = {m.CKPT_REQUEST_ENV: "9", m.CKPT_STEP_ENV: "120", m.CKPT_HOLD_ENV: "30"}
    msg = _order(Order.CHECKPOINT, 8, env)
    assert isinstance(msg.data, m.OrderData)
    ask = order_policy.checkpoint_request(msg, msg.data)
    assert ask == order_policy.CheckpointRequest(9, 120, 30.0)
    bare = _order(Order.CHECKPOINT, 8)
    assert isinstance(bare.data, m.OrderData)
    assert order_policy.checkpoint_request(bare, bare.data) == order_policy.CheckpointRequest(
        8, 0, 0.0
    )  # the round's seq is the request's id


def test_a_rounds_environment_has_torchruns_names_and_not_the_checks_keys() -> None:
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "CHECK_MASTER_PORT": "29600"}
    assert order_policy.round_env(env) == {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
        "PET_MASTER_ADDR": "10.0.0.1", "PET_MASTER_PORT": "29500",
    }  # fmt: skip


def test_the_checks_run_collectively_only_with_a_port_and_count_a_hang_only_when_held() -> None:
    settings = link_settings.LinkSettings("x:1", "ns", "job", "job-1", "t", ckpt_dir=Path("/ck"))
    order = m.OrderData(Order.TROUBLESHOOT, env={"MASTER_ADDR": "10.0.0.1",
                                                 "CHECK_MASTER_PORT": "29600",
                                                 m.HUNG_PODS_ENV: "job-0"})  # fmt: skip
    checks = order_policy.check_settings(order, settings, 1, 2, True, None)
    assert checks.group is not None and (checks.group.rank, checks.group.world_size) == (1, 2)
    assert checks.group.master_addr == "10.0.0.1" and checks.group.master_port == 29600
    assert not checks.hung  # job-0 is held hung, not this pod
    assert checks.ckpt_dir == Path("/ck/job-1")
    alone = order_policy.check_settings(m.OrderData(Order.TROUBLESHOOT), SETTINGS, None, 0, True,
                                        None)  # fmt: skip
    assert alone.group is None and alone.hung and alone.ckpt_dir is None


class _Training:
    """A fake training: what the executor asked of it."""

    def __init__(self) -> None:
        self.running = False
        self.restart_count = 0
        self.calls: list[tuple[str, object]] = []

    async def start(self, env: Mapping[str, str] | None = None) -> None:
        self.calls.append(("start", dict(env or {})))
        self.running = True

    async def restart(self, env: Mapping[str, str] | None = None) -> None:
        self.calls.append(("restart", dict(env or {})))
        self.running = True
        self.restart_count += 1

    async def stop(self) -> ports.ExitReport | None:
        self.calls.append(("stop", None))
        self.running = False
        return None

    def request_checkpoint(self, request_id: int, target_step: int, hold_s: float) -> None:
        self.calls.append(("checkpoint", (request_id, target_step, hold_s)))

    def progress(self) -> ports.Progress:
        return ports.Progress(takes_checkpoint_requests=True)


async def test_the_executor_runs_each_round_once_and_ends_on_exit() -> None:
    the_link = link.MasterLink(SETTINGS)
    training = _Training()
    for msg in (
        _order(Order.RUN, 3, {"MASTER_PORT": "1"}),
        _order(Order.RUN, 3, {"MASTER_PORT": "1"}),  # re-sent after a failover: ignored
        _order(Order.CHECKPOINT, 4, {m.CKPT_REQUEST_ENV: "4", m.CKPT_STEP_ENV: "10"}),
        _order(Order.RUN, 5, {"MASTER_PORT": "2"}),  # a new round while running: in place
        _order(Order.EXIT, 6, exit_code=3),
    ):
        the_link.orders.put_nowait(msg)
    await asyncio.wait_for(executor.OrderExecutor(the_link, training).run(), timeout=60)
    assert training.calls == [
        ("start", {"MASTER_PORT": "1", "PET_MASTER_PORT": "1"}),
        ("checkpoint", (4, 10, 0.0)),
        ("restart", {"MASTER_PORT": "2", "PET_MASTER_PORT": "2"}),
        ("stop", None),
    ]
    assert the_link.run_round == (Phase.RUN_COMMAND, 5) and the_link.done.result() == 3


def test_the_pod_the_master_names_hung_is_the_rounds_suspect_and_checked_first() -> None:
    order = m.OrderData(Order.TROUBLESHOOT, env={m.HUNG_PODS_ENV: "job-0,job-1"})
    assert order_policy.check_settings(order, SETTINGS, 1, 2, False, None).suspect
    other = link_settings.LinkSettings("x:1", "ns", "job", "job-2", "t")
    assert not order_policy.check_settings(order, other, 2, 3, False, None).suspect
    # no name list: nobody is a suspect (a hang with no culprit, an older master)
    plain = m.OrderData(Order.TROUBLESHOOT)
    assert not order_policy.check_settings(plain, SETTINGS, 1, 2, True, None).suspect
    assert not order_policy.suspected({m.HUNG_PODS_ENV: ""}, "job-1")


def test_only_a_newer_rounds_order_supersedes_a_check_round() -> None:
    assert order_policy.supersedes(3, 4)
    assert not order_policy.supersedes(3, 3) and not order_policy.supersedes(4, 3)


async def test_a_newer_rounds_order_ends_the_check_round_still_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The master ended a troubleshooting round without this pod's answer (its suspect's node
    was checked first): the next round's order does not wait for the checks still running here
    (a collective waiting for a peer that will not come); they end, and send nothing."""
    rounds: list[str] = []
    blocked = asyncio.Event()

    async def troubleshoot(settings: object) -> list[m.CheckResult]:
        rounds.append("started")
        if len(rounds) == 1:
            blocked.set()
            try:
                await asyncio.Event().wait()  # the peer never comes
            except asyncio.CancelledError:
                rounds.append("abandoned")
                raise
        return []

    monkeypatch.setattr(executor.suites, "troubleshoot", troubleshoot)
    the_link = link.MasterLink(SETTINGS)
    sent: list[tuple[m.MessageType, object]] = []

    async def send(kind: m.MessageType, data: m.Payload, round_: object = None) -> None:
        sent.append((kind, round_))

    the_link.send = send  # type: ignore[method-assign]
    training = _Training()
    task = asyncio.create_task(executor.OrderExecutor(the_link, training).run())
    the_link.orders.put_nowait(_order(Order.TROUBLESHOOT, 3))
    await asyncio.wait_for(blocked.wait(), timeout=60)
    the_link.orders.put_nowait(_order(Order.TROUBLESHOOT, 5))  # the round after the eviction
    await async_wait_until(lambda: sent, what="the answer of round 5")
    the_link.orders.put_nowait(_order(Order.EXIT, 6, exit_code=0))
    await asyncio.wait_for(task, timeout=60)
    assert rounds == ["started", "abandoned", "started"]
    assert sent == [(m.MessageType.FINISH, (Phase.RUN_COMMAND, 5))]  # none for round 3


async def test_an_order_of_the_same_round_waits_for_its_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = asyncio.Event()
    seen: list[str] = []

    async def troubleshoot(settings: object) -> list[m.CheckResult]:
        seen.append("checking")
        await gate.wait()
        seen.append("checked")
        return []

    monkeypatch.setattr(executor.suites, "troubleshoot", troubleshoot)
    the_link = link.MasterLink(SETTINGS)
    training = _Training()
    task = asyncio.create_task(executor.OrderExecutor(the_link, training).run())
    the_link.orders.put_nowait(_order(Order.TROUBLESHOOT, 3))
    the_link.orders.put_nowait(_order(Order.CHECKPOINT, 3, {m.CKPT_REQUEST_ENV: "9"}))
    await async_wait_until(lambda: seen == ["checking"], what="the checks of round 3 running")
    gate.set()
    the_link.orders.put_nowait(_order(Order.EXIT, 4, exit_code=0))
    await asyncio.wait_for(task, timeout=60)
    assert seen == ["checking", "checked"]  # finished, not abandoned


async def test_a_check_round_that_fails_ends_the_executor_with_its_error_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As when the round ran inline: the agent ends and its pod is replaced, rather than
    leaving the round unanswered while heartbeats say the pod is fine."""

    async def troubleshoot(settings: object) -> list[m.CheckResult]:
        raise RuntimeError("the checks broke")

    monkeypatch.setattr(executor.suites, "troubleshoot", troubleshoot)
    the_link = link.MasterLink(SETTINGS)
    the_link.orders.put_nowait(_order(Order.TROUBLESHOOT, 3))  # and no order after it
    with pytest.raises(RuntimeError, match="the checks broke"):
        await asyncio.wait_for(executor.OrderExecutor(the_link, _Training()).run(), timeout=60)


async def test_an_executor_stopped_during_a_check_round_ends_it_and_stops_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    running = asyncio.Event()
    ended: list[str] = []

    async def troubleshoot(settings: object) -> list[m.CheckResult]:
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            ended.append("checks")
        return []

    monkeypatch.setattr(executor.suites, "troubleshoot", troubleshoot)
    the_link = link.MasterLink(SETTINGS)
    the_link.orders.put_nowait(_order(Order.TROUBLESHOOT, 3))
    task = asyncio.create_task(executor.OrderExecutor(the_link, _Training()).run())
    await asyncio.wait_for(running.wait(), timeout=60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["checks"]


async def test_a_hang_over_is_no_longer_resent_and_the_pod_no_longer_hung() -> None:
    """A hang report goes again every few seconds until a newer round (a failover's new leader
    hears it). Once the watchdog's hang is over (the heartbeat tells the master, which
    withdraws the report), it is resent no more: a new leader would hold a report that no beat
    withdraws, and judge a healthy job hung. Other reports still go again."""
    from aegis.agent import encode

    the_link = link.MasterLink(SETTINGS)
    sender = encode.Sender("job", "ns", "job-1", "abcd")
    hang = encode.message(sender, 1, m.MessageType.HANG, the_link.run_round,
                          m.HangData(61.0, no_step_signal=True), 1.0)  # fmt: skip
    error = encode.message(sender, 2, m.MessageType.ERROR, the_link.run_round,
                           m.ErrorData("boom", "", 1), 2.0)  # fmt: skip
    the_link.hung, the_link.pending = True, [hang, error]
    await the_link.heartbeat(ports.Progress(hung=True))  # still hung
    assert the_link.pending == [hang, error] and the_link.hung
    await the_link.heartbeat(ports.Progress())  # moved again
    assert the_link.pending == [error] and not the_link.hung
    await the_link.close()
