"""Where a round meets (core/rendezvous.py), where a pod says it is (its ACK), and the order
environment the master materialises from both."""

from __future__ import annotations

import pytest

from aegis.agent.transport import pod_address
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.model import JobSpec, NodeName, PodName, initial_status
from aegis.core.phases import Phase
from aegis.core.rendezvous import TORCH_PORT, Endpoint, RendezvousRule, endpoint, host
from aegis.wire import messages as m
from aegis.wire.translate import is_address, to_event

SPEC = JobSpec("j", "ns", 3, 2)


def _never() -> int:
    raise AssertionError("a pod-owned range needs no probe")


def test_the_host_is_rank_0s_pod_address_once_known_else_the_fallback() -> None:
    status = initial_status(SPEC, [NodeName("a"), NodeName("b"), NodeName("c")])
    rule = RendezvousRule(fallback_host="{job}-0.{job}.{namespace}.svc", port_base=TORCH_PORT)
    assert host(rule, SPEC, status) == "j-0.j.ns.svc"
    placed = initial_status(SPEC, pod_ips=["10.0.0.5", "10.0.0.6", "10.0.0.7"])
    assert host(rule, SPEC, placed) == "10.0.0.5"
    moved, _ = machine.step(SPEC, placed, ev.PodRestarted(PodName("j-0"), NodeName("d"),
                                                          "10.0.0.9"), 1.0)  # fmt: skip
    assert host(rule, SPEC, moved) == "10.0.0.9"


def test_ports_come_from_the_pods_range_two_a_round_or_from_the_probe_on_a_shared_host() -> None:
    status = initial_status(SPEC, pod_ips=["10.0.0.5", "", ""])
    owned = RendezvousRule(port_base=29500, port_span=10)
    assert endpoint(owned, SPEC, status, 3, _never) == Endpoint("10.0.0.5", 29506)
    assert endpoint(owned, SPEC, status, 4, _never).port == 29508
    assert endpoint(owned, SPEC, status, 13, _never).port == 29506  # wraps after the span
    shared = RendezvousRule()
    assert endpoint(shared, SPEC, status, 3, lambda: 41234) == Endpoint("10.0.0.5", 41234)
    assert endpoint(shared, SPEC, initial_status(SPEC), 3, lambda: 1).host == "127.0.0.1"


@pytest.mark.parametrize(("base", "span"), [(-1, 10), (65000, 1000), (29500, 0)])
def test_a_range_that_is_not_ports_is_refused(base: int, span: int) -> None:
    with pytest.raises(ValueError, match="not valid ports"):
        RendezvousRule(port_base=base, port_span=span)


def _ack(ip: str) -> m.Message:
    return m.Message(job="j", namespace="ns", pod="j-0", type=m.MessageType.ACK,
                     phase=Phase.PENDING, seq=0, ts=0.0, data=m.AckData("a", ip))  # fmt: skip


def test_an_accepted_ack_records_where_the_pod_says_it_is() -> None:
    status = initial_status(SPEC, pod_ips=["10.0.0.5", "10.0.0.6", "10.0.0.7"])
    event = to_event(_ack("10.0.0.50"), job="j", namespace="ns")
    assert event == ev.PodAcked(PodName("j-0"), "10.0.0.50")
    after, _ = machine.step(SPEC, status, event, 1.0)
    assert after.pod_infos[PodName("j-0")].pod_ip == "10.0.0.50"
    # a duplicate ACK is rejected and changes nothing, its address included
    again, actions = machine.step(SPEC, after, ev.PodAcked(PodName("j-0"), "10.9.9.9"), 2.0)
    assert again is after and actions
    # an ACK that says nothing keeps what the platform said
    silent = to_event(_ack(""), job="j", namespace="ns")
    kept, _ = machine.step(SPEC, status, silent, 1.0)
    assert kept.pod_infos[PodName("j-0")].pod_ip == "10.0.0.5"


@pytest.mark.parametrize("text", ["10.0.0.1", "fe80::1", "node-1", "train-0.train.ml.svc"])
def test_addresses_a_pod_may_give(text: str) -> None:
    assert is_address(text)


@pytest.mark.parametrize("text", ["", "a b", "x\nFORGED", "-bad", "a" * 300, "1.2.3.4:80", "*"])
def test_what_is_no_address_is_ignored(text: str) -> None:
    assert not is_address(text)
    event = to_event(_ack(text), job="j", namespace="ns")
    assert event == ev.PodAcked(PodName("j-0"), None)


def test_a_pod_gives_the_platforms_address_else_its_own_toward_the_master() -> None:
    assert pod_address({"AEGIS_POD_IP": "198.18.0.11"}, "198.18.0.1:5000") == "198.18.0.11"
    assert pod_address({}, "127.0.0.1:5000,127.0.0.2:5001") == "127.0.0.1"
    assert pod_address({}, "no-port") == ""
    assert pod_address({}, "[::1]:5000") in ("", "::1")  # an IPv4 probe: no IPv6 route
