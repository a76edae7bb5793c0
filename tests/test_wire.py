"""Strict decoding of wire messages: one typed error for anything bad, never anything else."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.core.recovery import CheckType, Classification
from aegis.wire import codec, translate
from aegis.wire import messages as m
from aegis.wire.translate import to_event


def _msg(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "job": "llama",
        "namespace": "default",
        "pod": "llama-0",
        "type": "Error",
        "phase": "RunCommand",
        "seq": 2,
        "ts": 1.5,
        "data": {"kind": "error", "reason": "NCCL timeout", "fault_class": "nccl_timeout"},
    }
    base.update(overrides)
    return base


def test_decode_accepts_a_valid_error_message() -> None:
    msg = codec.decode(json.dumps(_msg()).encode())
    assert msg.type is m.MessageType.ERROR and msg.phase is Phase.RUN_COMMAND
    assert isinstance(msg.data, m.ErrorData) and msg.data.fault_class == "nccl_timeout"


def test_encode_then_decode_round_trips() -> None:
    result = m.CheckResult(CheckType.GPU, False, "ECC errors: 3", 0.5, 2.0)
    msg = m.Message(
        job="j",
        namespace="n",
        pod="j-1",
        type=m.MessageType.FINISH,
        phase=Phase.TROUBLESHOOTING,
        seq=4,
        ts=3.0,
        data=m.ChecksData(m.CheckResponse([result])),
    )
    assert codec.decode(codec.encode(msg)) == msg


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "malformed"),
        (b"", "malformed"),
        (b"[1,2,3]", "schema"),
        (json.dumps(_msg(seq="two")).encode(), "schema"),
        (json.dumps(_msg(type="Explode")).encode(), "schema"),
        (json.dumps(_msg(phase="Dancing")).encode(), "schema"),
        (json.dumps(_msg(extra=1)).encode(), "schema"),
        (json.dumps(_msg(data={"kind": "nope"})).encode(), "schema"),
        (json.dumps(_msg(data={"kind": "exit", "exit_code": 0})).encode(), "schema"),
        (json.dumps({k: v for k, v in _msg().items() if k != "pod"}).encode(), "schema"),
        (b"x" * (codec.MAX_MESSAGE_BYTES + 1), "oversized"),
    ],
    ids=[
        "truncated",
        "empty",
        "array",
        "wrong-type",
        "unknown-type",
        "unknown-phase",
        "unknown-field",
        "unknown-kind",
        "payload-not-for-type",
        "missing-field",
        "oversized",
    ],
)
def test_decode_rejects_bad_input_with_one_typed_error(raw: bytes, reason: str) -> None:
    with pytest.raises(codec.WireError) as caught:
        codec.decode(raw)
    assert caught.value.reason == reason


@given(st.binary(max_size=512))
def test_decode_of_arbitrary_bytes_raises_only_wire_error(raw: bytes) -> None:
    with contextlib.suppress(codec.WireError):
        codec.decode(raw)


@given(st.dictionaries(st.sampled_from(list(_msg())), st.none() | st.integers() | st.text()))
def test_decode_of_arbitrary_objects_raises_only_wire_error(fields: dict[str, object]) -> None:
    with contextlib.suppress(codec.WireError):
        codec.decode(json.dumps(fields).encode())


def test_translate_refuses_message_of_another_job() -> None:
    msg = codec.decode(json.dumps(_msg(job="other")).encode())
    with pytest.raises(codec.WireError) as caught:
        to_event(msg, job="llama", namespace="default")
    assert caught.value.reason == "wrong_job"


def test_translate_maps_finish_of_checks_to_classified_report() -> None:
    data = {
        "kind": "checks",
        "response": {
            "results": [
                {"check_type": "io", "passed": True, "result": "ok", "duration_s": 1, "ts": 1},
                {
                    "check_type": "gpu",
                    "passed": False,
                    "result": "Xid 79",
                    "duration_s": 1,
                    "ts": 1,
                },
            ]
        },
    }
    raw = json.dumps(_msg(type="Finish", phase="Troubleshooting", data=data)).encode()
    event = to_event(codec.decode(raw), job="llama", namespace="default")
    assert isinstance(event, ev.ChecksReported)
    assert event.verdict is Classification.HARDWARE and "gpu: Xid 79" in event.reason


@pytest.mark.parametrize(
    ("check", "timed_out", "verdict"),
    [
        ("runtime", False, Classification.RUNTIME),  # broken environment: restart the container
        ("runtime", True, Classification.SLOW),  # ran out of time: the node is slow, move off
        ("io", True, Classification.HARDWARE),  # a hardware check stays hardware
    ],
)
def test_a_check_that_ran_out_of_time_is_classified_by_what_it_means(
    check: str, timed_out: bool, verdict: Classification
) -> None:
    result = {"check_type": check, "passed": False, "result": "timeout after 10 s",
              "duration_s": 10, "ts": 1, "timed_out": timed_out}  # fmt: skip
    data = {"kind": "checks", "response": {"results": [result]}}
    raw = json.dumps(_msg(type="Finish", phase="BootChecking", data=data)).encode()
    event = to_event(codec.decode(raw), job="llama", namespace="default")
    assert isinstance(event, ev.ChecksReported) and event.verdict is verdict


def test_translate_heartbeat_is_not_a_core_event() -> None:
    raw = json.dumps(_msg(type="Heartbeat", data={"kind": "heartbeat", "step": 3})).encode()
    assert to_event(codec.decode(raw), job="llama", namespace="default") is None


def test_a_report_id_longer_than_its_bound_is_refused() -> None:
    """The master remembers the last 65,536 report ids of a job: an id is bounded, so a peer
    cannot make that memory gigabytes."""
    codec.decode(json.dumps(_msg(id="p" * m.ID_CHARS)).encode())
    with pytest.raises(codec.WireError) as caught:
        codec.decode(json.dumps(_msg(id="p" * (m.ID_CHARS + 1))).encode())
    assert caught.value.reason == "schema"


def test_a_peers_long_text_enters_the_event_cut_to_its_bound() -> None:
    """A reason or a check's result of 200 KB fits in a message; the event (and so the job's
    record, one value in the store) carries its first ``TEXT_CHARS``."""
    long = "x" * 200_000
    error = codec.decode(json.dumps(_msg(data={"kind": "error", "reason": long,
                                               "fault_class": "c" * 1000})).encode())  # fmt: skip
    event = to_event(error, job="llama", namespace="default")
    assert isinstance(event, ev.PodErrored)
    assert event.fault_class == "c" * translate.CLASS_CHARS
    assert len(event.reason) == translate.TEXT_CHARS and event.reason.endswith("x")
    result = m.CheckResult(CheckType.GPU, False, long, 0.5, 2.0)
    checks = codec.decode(codec.encode(m.Message(
        job="llama", namespace="default", pod="llama-0", type=m.MessageType.FINISH,
        phase=Phase.TROUBLESHOOTING, seq=4, ts=3.0, data=m.ChecksData(m.CheckResponse([result])),
    )))  # fmt: skip
    reported = to_event(checks, job="llama", namespace="default")
    assert isinstance(reported, ev.ChecksReported)
    assert len(reported.reason) == translate.TEXT_CHARS
