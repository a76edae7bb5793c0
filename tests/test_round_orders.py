"""A round's orders with their environment (``master.round_orders``, pure)."""

from __future__ import annotations

import itertools

from aegis.core import actions as act
from aegis.core.model import JobSpec, initial_status
from aegis.core.phases import Order, Phase
from aegis.core.rendezvous import RendezvousRule
from aegis.core.stragglers import Straggler
from aegis.master import job_record
from aegis.master.round_orders import RoundOrder, round_env, tie_scores
from aegis.wire import messages as m

SPEC = JobSpec("j", "default", 2, 1)


def _env(order: Order, **kw: object) -> dict[str, str]:
    ports = itertools.count(40000)
    status = initial_status(SPEC)
    send = act.SendOrder(order, Phase.RUN_COMMAND, 7)
    return round_env(send, SPEC, status, RendezvousRule(), lambda: next(ports),
                     scores=kw.get("scores", {}), resume=kw.get("resume"))  # type: ignore[arg-type]  # fmt: skip


def test_training_and_check_rounds_meet_on_their_own_ports() -> None:
    run = _env(Order.RUN, resume=120)
    assert set(run) == {"MASTER_ADDR", "MASTER_PORT", m.RESUME_STEP_ENV}
    assert run[m.RESUME_STEP_ENV] == "120"
    check = _env(Order.BOOTCHECK, resume=120)  # a check round resumes nothing
    assert set(check) == {"MASTER_ADDR", "CHECK_MASTER_PORT"}
    assert _env(Order.EXIT) == {} and _env(Order.STOP) == {}


def test_a_troubleshooting_round_names_the_hung_pods_and_the_scores() -> None:
    env = _env(Order.TROUBLESHOOT, scores={"j-1": 0.4, "j-0": 0.0})
    assert env[m.HUNG_PODS_ENV] == ""  # none held hung
    assert env[m.STRAGGLER_SCORES_ENV] == "j-0=0.000,j-1=0.400"
    assert m.STRAGGLER_SCORES_ENV not in _env(Order.TROUBLESHOOT)  # no scores yet: no key
    assert set(_env(Order.TROUBLESHOOT)) <= m.ORDER_ENV_KEYS  # the agent keeps every key


def test_an_order_survives_the_record() -> None:
    order = RoundOrder(Order.EXIT, Phase.RESTARTING, 9, ("j-1",), 75, {"A": "b"})
    record = job_record.build(SPEC, initial_status(SPEC), job_record.JobNotes(), [order])
    assert job_record.decode(job_record.encode(record)).orders == [order]


def test_only_a_named_straggler_of_a_slowdown_round_breaks_a_tie() -> None:
    named = Straggler("j-2", 0.5, 4, 4)
    run, slow = Phase.RUN_COMMAND, True
    assert tie_scores(Order.TROUBLESHOOT, run, slow, named) == {"j-2": 0.5}
    assert tie_scores(Order.TROUBLESHOOT, run, slow, None) == {}  # nobody named
    assert tie_scores(Order.TROUBLESHOOT, run, False, named) == {}  # a fault's round
    assert tie_scores(Order.TROUBLESHOOT, Phase.RESTARTING, slow, named) == {}  # after eviction
    assert tie_scores(Order.BOOTCHECK, run, slow, named) == {}
    assert tie_scores(Order.TROUBLESHOOT, run, slow, Straggler("j-2", -0.1, 4, 4)) == {}
