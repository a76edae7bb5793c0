"""The job's record in the status bucket (``master.job_record``): a record written by the master
before the record was a struct (a dict with its extras) is read and adopted by this one, and
what this one writes has the same fields (a master of the older version, or ``aegis status
--nats``, reads it)."""

from __future__ import annotations

import json
import logging

import pytest

from aegis.adapters import memory
from aegis.core.model import PodName
from aegis.core.phases import Order, Phase
from aegis.master import job_builder, job_record, pace, records
from aegis.master.job_runner import JobSettings, status_key
from aegis.master.ports import NullPlatform
from aegis.master.round_orders import RoundOrder
from aegis.wire import codec, job_summary
from aegis.wire import messages as m

_POD = (
    '{"pod_ip": "10.0.0.%d", "node": "node-%d", "inner_phase": "RunCommand", "finished": false,'
    ' "retries": 0, "last_failed_reason": "", "updated_ts": 5.0, "seq": 2, "slow": false,'
    ' "drain": false, "verdict": null, "evict": null}'
)
# As the master wrote it before (json.dumps of status_json.to_dict plus orders, epoch and the
# extras), mid-job: RunCommand, a committed step, a watchdog, straggler scores, a node moved.
OLD_RECORD = (
    '{"spec": {"job": "up", "namespace": "default", "worker_num": 2, "max_retry": 3, '
    '"software_restart": true, "repeat_limit": 3}, "status": {"phase": "RunCommand", '
    '"recover_count": 1, "should_quit": false, "seq": 2, "pod_infos": {"up-0": '
    + _POD % (1, 0)
    + ', "up-1": '
    + _POD % (2, 1)
    + '}, "error_nodes": [], "repeat": {"step": -1, "reason": "", '
    '"count": 0}}, "orders": [{"order": "run", "phase": "RunCommand", "seq": 2, "pods": '
    '["up-0", "up-1"], "exit_code": 0, "env": {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": '
    '"29500", "AEGIS_RESUME_STEP": "20"}}], "epoch": 3, "token": "tok", "nodes": ["node-0", '
    '"node-1"], "hardware_rescheduled": 1, "committed_step": 20, "watchdogs": {"up-1": '
    '"hang timeout 600 s"}, "stragglers": {"scores": {"up-0": 0.0, "up-1": 1.5}, "named": '
    '"up-1", "why": "late in 3 of 3 windows"}}'
)
ENV = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "AEGIS_RESUME_STEP": "20"}
RUN = RoundOrder(Order.RUN, Phase.RUN_COMMAND, 2, ("up-0", "up-1"), 0, ENV)


def test_a_record_of_the_earlier_master_is_read_with_its_orders_and_notes() -> None:
    record, spec, status = records.decode_record(OLD_RECORD.encode())
    assert (spec.job, status.phase, status.seq, status.recover_count) == ("up", Phase.RUN_COMMAND,
                                                                          2, 1)  # fmt: skip
    assert record.orders == [RUN] and record.epoch == 3
    notes = record.notes
    assert (notes.token, notes.nodes, notes.committed_step) == ("tok", ["node-0", "node-1"], 20)
    assert notes.hardware_rescheduled == 1 and notes.watchdogs == {"up-1": "hang timeout 600 s"}
    assert notes.stragglers["named"] == "up-1"


async def test_a_job_written_by_the_earlier_master_is_adopted_mid_job() -> None:
    """An upgraded leader takes the job over: the round's order goes out again as it was, the
    record it writes keeps every field, and the old reader's fields are all there."""
    store, bus = memory.MemoryStore(), memory.MemoryBus()
    revision = await store.put("default.up", OLD_RECORD.encode(), expected_revision=None)
    record, _, _ = records.decode_record(OLD_RECORD.encode())
    builder = job_builder.JobBuilder(bus, store, JobSettings(heartbeat_timeout_s=60))
    runner = builder.adopt(record, revision, NullPlatform(), None, epoch=4, fence=lambda: None)
    sent: list[m.Message] = []

    async def on_order(subject: str, payload: bytes) -> None:
        sent.append(codec.decode(payload))

    await bus.subscribe(runner.master_subject, on_order)
    await runner.takeover()
    await bus.flush()
    assert [(o.epoch, o.seq, o.data) for o in sent] == [
        (4, 2, m.CommittedData(20)),  # the savers keep step 20 on: the old word may be lost
        (4, 2, m.CommittedData(20)),  # said before every training round's order
        (4, 2, m.OrderData(Order.RUN, ["up-0", "up-1"], 0, RUN.env)),
    ]
    assert runner.safe.committed_step == 20
    got = await store.get(status_key(runner.spec))
    assert got is not None and got[1] > revision
    written, old = json.loads(got[0]), json.loads(OLD_RECORD)
    assert written == {**old, "epoch": 4}  # the same fields, the new leader's epoch
    assert job_summary.from_record(written).hardware_rescheduled == 1
    assert runner.prefix == "aegis.default.up"  # no creation id: its pods' subjects as before
    await runner.unsubscribe()


async def test_a_new_leader_keeps_the_jobs_creation_id_and_so_its_subjects() -> None:
    """Its pods report on ``aegis.<ns>.<job>.<creation>`` after a failover as before it, and a
    new job of a name gets another id (a cut-off master's pods never share its subjects)."""
    store, bus = memory.MemoryStore(), memory.MemoryBus()
    builder = job_builder.JobBuilder(bus, store, JobSettings(heartbeat_timeout_s=60))
    _, spec, status = records.decode_record(OLD_RECORD.encode())
    first, second = (builder.new(spec, status, NullPlatform(), None) for _ in range(2))
    assert first.notes.creation != second.notes.creation
    assert first.prefix == f"aegis.default.up.{first.notes.creation}"
    raw = job_record.encode(first.record())
    assert json.loads(raw)["creation"] == first.notes.creation
    revision = await store.put("default.up", raw, expected_revision=None)
    record, _, _ = records.decode_record(raw)
    adopted = builder.adopt(record, revision, NullPlatform(), None, epoch=1, fence=lambda: None)
    assert adopted.prefix == first.prefix and adopted.master_subject == f"{first.prefix}.master"
    await adopted.takeover()
    got = await store.get("default.up")
    assert got is not None and json.loads(got[0])["creation"] == first.notes.creation
    await adopted.unsubscribe()


def test_a_new_jobs_record_leaves_out_what_it_does_not_have_yet() -> None:
    """As before: no ``committed_step``, ``watchdogs``, ``stragglers`` or
    ``hardware_rescheduled`` until there is one (``aegis status`` tells "none yet" by it)."""
    _, spec, status = records.decode_record(OLD_RECORD.encode())
    fresh = job_record.build(spec, status, job_record.JobNotes(token="t", nodes=["n0", "n1"]))
    written = json.loads(job_record.encode(fresh))
    assert set(written) == {"spec", "status", "token", "nodes"}  # ("creation": builder.new's)
    assert job_record.decode(job_record.encode(fresh)) == fresh
    assert PodName("up-0") in fresh.job()[1].pod_infos


def _odd(**fields: object) -> bytes:
    return json.dumps(json.loads(OLD_RECORD) | fields).encode()


def test_notes_a_new_leader_can_go_without_are_dropped_where_they_have_another_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, one of them of another shape made the whole record malformed: the job was
    skipped by every replica, never adopted again. Now only those notes are lost."""
    raw = _odd(pace={"best": "fast"}, safe_points=[1, 2], watchdogs={"up-1": 5})
    with pytest.raises(ValueError):
        job_record.decode(raw)  # the strict reading refuses it
    record, dropped = job_record.read(raw)
    assert dropped == ("safe_points", "pace", "watchdogs")
    assert (record.pace, record.safe_points, record.watchdogs) == (None, None, {})
    assert (record.committed_step, record.token, record.epoch) == (20, "tok", 3)
    assert record.stragglers["named"] == "up-1" and record.orders == [RUN]
    with caplog.at_level(logging.WARNING, logger="aegis.master.records"):
        again, spec, _ = records.decode_record(raw)
    assert again == record and spec.job == "up"
    [line] = [r.getMessage() for r in caplog.records]
    assert "safe_points, pace, watchdogs" in line and "default.up" in line
    # a good note beside a bad one is kept
    fine = {"seq": 2, "best": 1.5, "world": [["up-0", "node-0"]]}
    kept, dropped = job_record.read(_odd(pace=fine, safe_points="x"))
    assert dropped == ("safe_points",) and kept.pace == pace.PaceNotes(
        seq=2, best=1.5, world=[("up-0", "node-0")]
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"committed_step": "x"},
        {"token": 5},
        {"orders": [{"order": "nonsense"}]},
        {"epoch": []},
        {"creation": "x.>"},
        {"creation": "0A1B2C3D"},
        {"creation": "0a1b2c3d0"},
        {"creation": "0a1b2c3d\n"},
    ],
    ids=[
        "committed",
        "token",
        "orders",
        "epoch",
        "creation-subject",
        "creation-upper",
        "creation-long",
        "creation-newline",
    ],
)
def test_a_bad_field_a_job_needs_still_makes_the_record_malformed(
    fields: dict[str, object],
) -> None:
    with pytest.raises(records.MalformedRecordError):
        records.decode_record(_odd(pace={"best": "fast"}, **fields))


async def test_a_record_with_notes_of_another_shape_is_adopted_and_written_whole() -> None:
    raw = _odd(pace={"best": "fast"}, stragglers=[1])
    store, bus = memory.MemoryStore(), memory.MemoryBus()
    revision = await store.put("default.up", raw, expected_revision=None)
    record, _, _ = records.decode_record(raw)
    builder = job_builder.JobBuilder(bus, store, JobSettings(heartbeat_timeout_s=60))
    runner = builder.adopt(record, revision, NullPlatform(), None, epoch=4, fence=lambda: None)
    await runner.takeover()
    got = await store.get(status_key(runner.spec))
    assert got is not None and got[1] > revision
    written = job_record.decode(got[0])  # strict: what the new leader wrote has the shape
    assert (written.committed_step, written.epoch, written.stragglers) == (20, 4, {})
    await runner.unsubscribe()
