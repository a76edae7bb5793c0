"""Which of the master's orders the agent takes, and what each one means: pure decisions (the
link and the executor act on them; no I/O, no clock).

- :func:`screen`: an order is taken only when it decodes, is signed with the master's key (a
  server without auth has none), is of this job; of its environment only the keys the master
  sends (``messages.ORDER_ENV_KEYS``) are kept, any other is dropped and named;
- an order of a deposed master (a lower epoch) is ignored (``messages.current_epoch``);
- :func:`held_step`: the job's committed step, which the pod's saver keeps;
- :func:`round_key`: each round is executed at most once (an order re-sent after a failover, or
  for a lost message, is ignored);
- :func:`for_pod`: an order addressed to some pods is taken by those only;
- :func:`plan`: what an order asks of the training (an :class:`Action`);
- :func:`supersedes`: an order of a newer round ends a check round still running;
- :func:`checkpoint_request`, :func:`round_env`: what a checkpoint order and a training round
  hand the training;
- :func:`check_settings`: the checks a bootcheck or troubleshooting order runs (this pod the
  round's suspect or not: :func:`suspected`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import msgspec

from aegis.agent import link_settings
from aegis.checks import host as check_host
from aegis.checks.base import DEFAULT_BUDGETS_S, CheckSettings, GroupInfo, PerfSettings
from aegis.core.phases import Order
from aegis.wire import codec
from aegis.wire import messages as m

NAMES_KEPT = 64  # distinct dropped environment keys counted by name; the rest as "(others)"
NAME_CHARS = 64

Verify = Callable[[bytes, str], bool]


@dataclass(frozen=True, slots=True)
class Accepted:
    msg: m.Message  # its data an OrderData (its environment cut to the known keys) or a
    # CommittedData
    dropped_env: tuple[str, ...] = ()  # the keys cut, sorted


@dataclass(frozen=True, slots=True)
class Dropped:
    reason: str  # a counter's name: not_an_order, unsigned, wrong_job, or the wire's reason
    detail: str


def screen(payload: bytes, verify: Verify | None, job: str, namespace: str) -> Accepted | Dropped:
    """The order (or the word of a committed step), signed by the master, of this job, with
    only the environment keys the agent knows; or why it is dropped."""
    try:
        msg = codec.decode(payload)
    except codec.WireError as exc:
        return Dropped(exc.reason, str(exc))
    if not isinstance(msg.data, m.OrderData | m.CommittedData):
        return Dropped("not_an_order", f"a {msg.type} on the master subject")
    what = msg.data.order if isinstance(msg.data, m.OrderData) else "committed"
    if verify is not None and not verify(codec.signed_part(msg), msg.sig):
        return Dropped("unsigned", f"{what}#{msg.seq} epoch {msg.epoch}")
    if (msg.job, msg.namespace) != (job, namespace):
        return Dropped("wrong_job", f"an order of {msg.namespace}/{msg.job}")
    if isinstance(msg.data, m.CommittedData):  # the job's committed step: no environment
        return Accepted(msg)
    if (bad := _bad_number(msg.data.env)) is not None:
        return Dropped("bad_env", bad)
    unknown = tuple(sorted(k for k in msg.data.env if k not in m.ORDER_ENV_KEYS))
    if not unknown:
        return Accepted(msg)
    env = {k: v for k, v in msg.data.env.items() if k in m.ORDER_ENV_KEYS}
    return Accepted(msgspec.structs.replace(msg, data=msgspec.structs.replace(msg.data, env=env)),
                    unknown)  # fmt: skip


_WHOLE = (m.CKPT_REQUEST_ENV, m.CKPT_STEP_ENV, m.RESUME_STEP_ENV)
_PORTS = ("MASTER_PORT", "CHECK_MASTER_PORT")


def _bad_number(env: Mapping[str, str]) -> str | None:
    """What is wrong with a number the agent reads from an order's environment (a whole
    number, a port, a hold of finite seconds), or None: an order with one is dropped and
    counted, not taken to crash the agent."""
    for key in (*_WHOLE, *_PORTS, m.CKPT_HOLD_ENV):
        text = env.get(key)
        if text is None:
            continue
        try:
            number = float(text) if key == m.CKPT_HOLD_ENV else int(text)
        except ValueError:
            return f"{key}={text[:NAME_CHARS]!r} is not a number"
        if key in _PORTS and not 0 < number < 65536:
            return f"{key}={number} is no port"
        if key == m.CKPT_HOLD_ENV and not (math.isfinite(number) and number >= 0):
            return f"{key}={number} is no hold"
    return None


def counted_as(name: str, counted: Collection[str]) -> str:
    """The counter a dropped key goes to: its name (cut), while few names are counted; else
    "(others)", so that however many names are tried the counters stay bounded."""
    kept = name[:NAME_CHARS]
    return kept if kept and (kept in counted or len(counted) < NAMES_KEPT) else "(others)"


def held_step(data: m.OrderData | m.CommittedData) -> int | None:
    """The job's committed step, as the master tells it (and again with each training round):
    the pod's saver keeps it and the newest steps after it; None: an order. Not a round's
    ``AEGIS_RESUME_STEP``: a master that never tells the committed step sends that too, and the
    saver would hold it for the whole run."""
    return data.step if isinstance(data, m.CommittedData) else None


def for_pod(order: m.OrderData, pod: str) -> bool:
    """Whether the order is for ``pod`` (an order that names no pod is for every one)."""
    return not order.pods or pod in order.pods


def round_key(msg: m.Message, order: m.OrderData) -> tuple[int, str]:
    """What makes an order a round of its own: its seq and order (a checkpoint request's id
    too: several can come in one round)."""
    return msg.seq, order.order.value + order.env.get(m.CKPT_REQUEST_ENV, "")


class Action(enum.Enum):
    """What an order asks of the training (the executor does it, with the order's data)."""

    START = "start"  # start the training for a new round, with the round's environment
    RESTART = "restart"  # restart it in place (a restart, or a new round while it runs)
    STOP = "stop"  # SIGTERM to its group, grace, SIGKILL
    BOOTCHECK = "bootcheck"  # run the bootcheck
    TROUBLESHOOT = "troubleshoot"  # stop the training, run the troubleshooting checks
    EXIT = "exit"  # stop the training, and the agent with the order's exit code
    CHECKPOINT = "checkpoint"  # hand the training a checkpoint request
    NOTHING = "nothing"  # a checkpoint request with no training running


def plan(order: Order, running: bool) -> Action:
    """What ``order`` asks of the training, ``running`` or not."""
    match order:
        case Order.RUN:
            return Action.RESTART if running else Action.START
        case Order.RESTART:
            return Action.RESTART
        case Order.STOP:
            return Action.STOP
        case Order.BOOTCHECK:
            return Action.BOOTCHECK
        case Order.TROUBLESHOOT:
            return Action.TROUBLESHOOT
        case Order.EXIT:
            return Action.EXIT
        case Order.CHECKPOINT:
            return Action.CHECKPOINT if running else Action.NOTHING
        case _:
            assert_never(order)


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """Save at ``target_step`` (at once if past it), then hold ``hold_s`` seconds."""

    request: int  # its id (the round's seq unless the order names one)
    target_step: int
    hold_s: float


def checkpoint_request(msg: m.Message, order: m.OrderData) -> CheckpointRequest:
    env = order.env
    return CheckpointRequest(int(env.get(m.CKPT_REQUEST_ENV, str(msg.seq))),
                             int(env.get(m.CKPT_STEP_ENV, "0")),
                             float(env.get(m.CKPT_HOLD_ENV, "0")))  # fmt: skip


def round_env(order_env: Mapping[str, str]) -> dict[str, str]:
    """The training's environment for a round: the order's, with torchrun's PET_ names of the
    rendezvous, without the checks' keys."""
    env = {k: v for k, v in order_env.items() if not k.startswith("CHECK_")}
    if "MASTER_ADDR" in env:
        env["PET_MASTER_ADDR"] = env["MASTER_ADDR"]
    if "MASTER_PORT" in env:
        env["PET_MASTER_PORT"] = env["MASTER_PORT"]
    return env


def check_settings(
    order: m.OrderData,
    settings: link_settings.LinkSettings,
    rank: int | None,
    world_size: int,
    hang_reported: bool,
    host: check_host.CheckHost | None,
) -> CheckSettings:
    """The checks of a bootcheck or troubleshooting order (``rank`` None: no credentials, so
    no collective checks); ``hang_reported``: a hang was reported in the round."""
    group = None
    if rank is not None and "CHECK_MASTER_PORT" in order.env:
        group = GroupInfo(rank=rank, world_size=world_size,
                          master_addr=order.env.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=int(order.env["CHECK_MASTER_PORT"]))  # fmt: skip
    s, configured = settings, settings.checks
    ckpt_dir: Path | None = s.ckpt_dir / s.pod if s.ckpt_dir else None
    return CheckSettings(
        scratch_dir=s.scratch_dir,
        budgets_s={**DEFAULT_BUDGETS_S, **configured.budgets_s},
        enabled=configured.enabled,
        inject=s.inject,
        group=group,
        hung=hang_reported and held_hung(order.env, s.pod),
        suspect=suspected(order.env, s.pod),
        host=host,
        ckpt_dir=ckpt_dir,
        perf=PerfSettings(straggler_score=own_score(order.env, s.pod)),
    )


def held_hung(env: Mapping[str, str], pod: str) -> bool:
    """Whether this pod's hang counts in the checks: the master names the pods it holds hung
    (a rank that waited in a collective for the stuck one is not); no name list: it does."""
    named = env.get(m.HUNG_PODS_ENV)
    return named is None or pod in named.split(",")


def suspected(env: Mapping[str, str], pod: str) -> bool:
    """Whether the master names this pod as the round's suspect (held hung or slow): its node's
    own checks run first (``checks.suites``; the master ends the round on its answer when they
    say it must leave)."""
    return pod in env.get(m.HUNG_PODS_ENV, "").split(",")


CHECK_ACTIONS = frozenset({Action.BOOTCHECK, Action.TROUBLESHOOT})


def supersedes(round_seq: int, order_seq: int) -> bool:
    """Whether an order of round ``order_seq`` ends the check round ``round_seq`` still running
    here: a newer round means the master has decided without this pod's answer (the suspect's
    node was checked first, or the pod is being replaced), so the answer would be stale and its
    checks (a collective waiting for a peer that will not come) only hold up the new order."""
    return order_seq > round_seq


def own_score(env: Mapping[str, str], pod: str) -> float:
    """This pod's straggler score in a troubleshooting order (0.0: none, or not a number)."""
    for entry in env.get(m.STRAGGLER_SCORES_ENV, "").split(","):
        name, _, value = entry.partition("=")
        if name == pod:
            try:
                score = float(value)
            except ValueError:
                return 0.0
            return score if math.isfinite(score) and score > 0 else 0.0
    return 0.0
