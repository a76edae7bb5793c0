"""Observability pieces without a job: the live view's rendering, the view choice, the fault
log's rotation and incident rule, and the control channel over the in-memory bus."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import cast

import msgspec
import pytest
from rich.console import Console

from aegis.adapters.memory import MemoryBus
from aegis.cli import live_view, run_cmd, run_view
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.incidents import Incident, IncidentTracker
from aegis.core.model import JobSpec, NodeName, PodName, initial_status
from aegis.core.phases import Order, Phase
from aegis.core.recovery import RecoveryLevel
from aegis.master import control, control_file, eventlog_writer, faultlog, job_log
from aegis.master.job_record import JobNotes
from aegis.master.job_runner import JobRunner
from aegis.tools import joblog

SPEC = JobSpec("demo", "default", 3, 2)


def test_live_view_renders_pods_phase_and_progress_bar_when_steps_are_reported() -> None:
    status = initial_status(SPEC, [NodeName("node-0"), NodeName("node-1"), NodeName("node-2")])
    state = live_view.ViewState(SPEC, status, total_steps=100, started=1000.0)
    state.steps = {"demo-0": 40, "demo-1": 42, "demo-2": 41}
    state.last_event["demo-1"] = (1000.0, "error: nccl_timeout: watchdog")
    console = Console(record=True, file=io.StringIO(), width=120, force_terminal=True)
    console.print(live_view.render(state, now=1012.0))
    text = console.export_text()
    assert "job demo Pending" in text and "(12 s)" in text
    assert "max restarts 2, restarted 0 times; hardware problems rescheduled 0 times" in text
    assert "step 40/100" in text  # the slowest pod
    assert "error: nccl_timeout: watchdog" in text
    for pod, node in (("demo-0", "node-0"), ("demo-1", "node-1"), ("demo-2", "node-2")):
        assert any(pod in line and node in line for line in text.splitlines())


def test_live_view_shows_the_step_without_a_bar_when_the_total_is_unknown() -> None:
    state = live_view.ViewState(SPEC, initial_status(SPEC), steps={"demo-0": 7, "demo-1": 9})
    console = Console(record=True, file=io.StringIO(), width=120)
    console.print(live_view.render(state))
    assert "step 7 (slowest pod)" in console.export_text()


def test_choose_view_is_plain_when_output_is_not_a_tty() -> None:
    plain = run_cmd.choose_view("auto", Console(file=io.StringIO()), None)
    assert isinstance(plain, run_view.PlainView)
    tty = Console(file=io.StringIO(), force_terminal=True)
    assert isinstance(run_cmd.choose_view("auto", tty, 10), live_view.LiveView)
    assert isinstance(run_cmd.choose_view("plain", tty, 10), run_view.PlainView)


def test_fault_log_rotates_by_size_and_keeps_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "faults.jsonl"
    out = faultlog.RotatingJsonLines(path, max_bytes=200, backups=2)
    for index in range(40):
        out.write({"n": index, "message": "x" * 20})
    out.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["faults.jsonl", "faults.jsonl.1", "faults.jsonl.2"]
    numbers = []
    for name in ("faults.jsonl.2", "faults.jsonl.1", "faults.jsonl"):
        text = (tmp_path / name).read_text()
        assert len(text.encode()) <= 200
        numbers += [json.loads(line)["n"] for line in text.splitlines()]
    assert numbers == list(range(40 - len(numbers), 40))  # newest kept, in order, none split


def test_incident_tracker_opens_on_a_fault_and_closes_back_in_run_command() -> None:
    tracker = IncidentTracker("demo")
    pod = PodName("demo-1")
    status = initial_status(SPEC)
    troubleshooting = status.__class__(**{**_fields(status), "phase": Phase.TROUBLESHOOTING})
    running = status.__class__(**{**_fields(status), "phase": Phase.RUN_COMMAND})
    fault = (act.RecordFault(pod, "exit code 1", counted=True),)
    error = ev.PodErrored(pod, Phase.RUN_COMMAND, 1, "exit code 1")
    change = tracker.feed(Phase.RUN_COMMAND, error, troubleshooting, fault, 10.0)
    assert change.closed is None and change.opener == fault[0]
    assert change.opened is tracker.current and tracker.current is not None
    assert tracker.current.id == "demo#1"
    restart = (act.SendOrder(Order.RESTART, Phase.RUN_COMMAND, 4),)
    checked = ev.PodFinished(pod, Phase.TROUBLESHOOTING, 2, 0)
    closed = tracker.feed(Phase.TROUBLESHOOTING, checked, running, restart, 14.5).closed
    assert closed is not None and closed.level is RecoveryLevel.IN_PLACE
    assert (closed.closed_ts, closed.outcome) == (14.5, Phase.RUN_COMMAND)
    evict = (act.EvictPod(pod, RecoveryLevel.NODE, 1, "gpu"),)
    tracker.feed(Phase.RUN_COMMAND, error, troubleshooting, fault, 20.0)
    again = tracker.feed(Phase.TROUBLESHOOTING, checked, troubleshooting, evict, 21.0)
    assert again.opened is None and again.closed is None  # the open one takes the eviction
    closed = tracker.feed(Phase.TROUBLESHOOTING, checked, running, restart, 30.0).closed
    assert closed is not None and (closed.id, closed.level_name) == ("demo#2", "node_replaced")


def test_a_slowdown_that_stops_training_opens_an_incident_of_its_own() -> None:
    """No fault is recorded, but the checks run: the fault log, the metrics and ``aegis
    incidents`` all count it (one rule), and a round that finds nothing closes it uncounted."""
    tracker = IncidentTracker("demo")
    status = initial_status(SPEC)
    troubleshooting = status.__class__(**{**_fields(status), "phase": Phase.TROUBLESHOOTING})
    running = status.__class__(**{**_fields(status), "phase": Phase.RUN_COMMAND})
    slowed = ev.SlowdownReported("12 steps/s, below 50% of 25")
    order = (act.SendOrder(Order.TROUBLESHOOT, Phase.TROUBLESHOOTING, 3),)
    change = tracker.feed(Phase.RUN_COMMAND, slowed, troubleshooting, order, 5.0)
    assert change.opened is not None and change.opener is None and change.opened.id == "demo#1"
    ignored = tracker.feed(Phase.RUN_COMMAND, slowed, running, (), 6.0)  # not stopped: nothing
    assert ignored.opened is None and tracker.current is change.opened
    restart = (act.SendOrder(Order.RESTART, Phase.RUN_COMMAND, 4),)
    done = ev.PodFinished(PodName("demo-0"), Phase.TROUBLESHOOTING, 2, 0)
    closed = tracker.feed(Phase.TROUBLESHOOTING, done, running, restart, 9.0).closed
    assert closed is change.opened and closed is not None
    assert (closed.counted, closed.level, closed.outcome) == (False, None, Phase.RUN_COMMAND)


def _fields(status: object) -> dict[str, object]:
    return {name: getattr(status, name) for name in status.__slots__}  # type: ignore[attr-defined]


class _Platform:
    def __init__(self) -> None:
        self.blacklist: dict[str, str] = {"node-9": "old"}


async def test_control_answers_requests_over_the_bus_when_no_job_matches() -> None:
    bus = MemoryBus()
    platform = _Platform()
    sub = await control.serve_control(bus, lambda namespace, job: None, lambda: [platform])
    assert sub.subject.startswith(control.CONTROL_SUBJECT + ".")
    reply = await control.request(
        bus, lambda inbox: control.ControlRequest("stop", inbox, job="gone"), inbox_prefix="_I",
        subject=sub.subject,
    )  # fmt: skip
    assert reply == control.ControlReply(False, "no job default/gone")
    reply = await control.request(
        bus,
        lambda inbox: control.ControlRequest("taint", inbox, nodes=["a", "b"], reason="ecc"),
        inbox_prefix="_I",
        subject=sub.subject,
    )
    assert reply.ok and platform.blacklist == {"node-9": "old", "a": "ecc", "b": "ecc"}
    reply = await control.request(
        bus, lambda inbox: control.ControlRequest("untaint", inbox, nodes=["node-9", "a"]),
        inbox_prefix="_I", subject=sub.subject,
    )  # fmt: skip
    assert reply.ok and platform.blacklist == {"b": "ecc"}
    await sub.unsubscribe()


class _Runner:
    def __init__(self) -> None:
        self.events: list[object] = []

    def platform_event(self, event: object) -> None:
        self.events.append(event)


async def _replies(
    bus: MemoryBus, subject: str, request: control.ControlRequest
) -> list[control.ControlReply]:
    """Every reply to ``request`` sent on ``subject`` (the masters' handlers, then their
    replies, run to their end)."""
    got: list[control.ControlReply] = []

    async def on_reply(_: str, payload: bytes) -> None:
        got.append(msgspec.json.decode(payload, type=control.ControlReply))

    sub = await bus.subscribe(request.reply_to, on_reply)
    await bus.publish(subject, msgspec.json.encode(request))
    await bus.flush()  # the handlers
    await bus.flush()  # their replies
    await sub.unsubscribe()
    return got


async def test_on_the_shared_subject_only_the_master_that_leads_the_job_answers() -> None:
    """Two masters on one bus (two runs on one NATS server), each with a subject of its own
    (its control file names it): there each answers all it is sent. On the shared subject a
    stop (or a hang) of a job is answered by the master that leads it, the other keeps silent;
    a node command there is nobody's."""
    bus, runner, platform = MemoryBus(), _Runner(), _Platform()
    leading = {("default", "one"): cast(JobRunner, runner)}
    one = await control.serve_control(bus, lambda ns, job: leading.get((ns, job)), lambda: [])
    two = await control.serve_control(bus, lambda ns, job: None, lambda: [platform])
    assert one.subject != two.subject and control.CONTROL_SUBJECT not in (one.subject, two.subject)
    stop = control.ControlRequest("stop", "_I.a", job="one")
    assert await _replies(bus, control.CONTROL_SUBJECT, stop) == [
        control.ControlReply(True, "job one: stop requested")
    ]
    assert len(runner.events) == 1
    assert await _replies(bus, two.subject, stop) == [
        control.ControlReply(False, "no job default/one")  # sent to the other: said so
    ]
    assert len(runner.events) == 1
    nobodys = control.ControlRequest("stop", "_I.b", job="gone")
    assert await _replies(bus, control.CONTROL_SUBJECT, nobodys) == []
    taint = control.ControlRequest("taint", "_I.c", nodes=["a"], reason="ecc")
    assert await _replies(bus, control.CONTROL_SUBJECT, taint) == []
    assert platform.blacklist == {"node-9": "old"}
    assert [r.ok for r in await _replies(bus, two.subject, taint)] == [True]
    assert platform.blacklist == {"node-9": "old", "a": "ecc"}
    hang = control.ControlRequest("hang", "_I.d", pod="one-0")
    assert control.leads(hang, lambda ns, job: leading.get((ns, job)))
    assert not control.leads(hang, lambda ns, job: None)
    ping = control.ControlRequest("ping", "_I.p", job="one")  # the master service's to answer
    assert await _replies(bus, control.CONTROL_SUBJECT, ping) == []
    await one.unsubscribe()
    await two.unsubscribe()
    assert bus.handlers == {}


async def test_the_leader_of_replicas_answers_every_request_on_the_shared_subject() -> None:
    """One leader per server (its lease): a control file made by hand or by an older version
    names no subject, and a master with no log directory writes none; it is reached there."""
    bus, platform = MemoryBus(), _Platform()
    lead = await control.serve_control(bus, lambda ns, job: None, lambda: [platform], leader=True)
    taint = control.ControlRequest("taint", "_I.e", nodes=["a"], reason="ecc")
    assert [r.ok for r in await _replies(bus, control.CONTROL_SUBJECT, taint)] == [True]
    assert platform.blacklist == {"node-9": "old", "a": "ecc"}
    stop = control.ControlRequest("stop", "_I.f", job="gone")
    assert await _replies(bus, control.CONTROL_SUBJECT, stop) == [
        control.ControlReply(False, "no job default/gone")
    ]
    # but a ping (it would say "no job" of a job another master leads: ``master.ping``)
    ping = control.ControlRequest("ping", "_I.g", job="gone")
    assert await _replies(bus, control.CONTROL_SUBJECT, ping) == []
    assert not control.leads(ping, lambda ns, job: None, leader=True)
    await lead.unsubscribe()


def test_control_file_is_owner_only_and_round_trips(tmp_path: Path) -> None:
    from aegis.adapters.nats_auth import Authority

    creds = Authority().master_creds()
    target = control_file.ControlTarget("nats://127.0.0.1:1", creds, "default", "demo")
    path = tmp_path / "control.json"
    control_file.write_control_file(path, target)
    assert path.stat().st_mode & 0o777 == 0o600
    back = control_file.read_control_file(path)
    assert back.creds is not None and back.creds.jwt == creds.jwt
    assert (back.nats_url, back.job, back.creds.seed) == (target.nats_url, "demo", creds.seed)


def test_a_master_keeps_one_replayable_event_log_per_job_it_leads(tmp_path: Path) -> None:
    """Under ``aegis master --log-dir D``: a job no one has led gets D/<ns>/<job>/events.jsonl
    begun with its JobCreated line; a log begun for this submission is continued, never begun
    twice; one of an earlier submission of the same name is set aside; a job that ran
    elsewhere before (no beginning here) is not logged at all."""
    spec = JobSpec("a", "ns1", 2, 1)
    fresh = initial_status(spec, [NodeName("n0"), NodeName("n1")])
    record = JobNotes(nodes=["n0", "n1"], token="first")
    directory = job_log.event_log_dir(tmp_path, spec, fresh, record)
    assert directory == tmp_path / "ns1" / "a"
    lines = (directory / "events.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["nodes"] == ["n0", "n1"]
    assert "first" not in (directory / ".submission").read_text()  # a digest, not the token
    assert job_log.event_log_dir(tmp_path, spec, fresh, record) == directory  # a second replica
    assert len((directory / "events.jsonl").read_text().splitlines()) == 1
    with (directory / "events.jsonl").open("a") as log_file:
        log_file.write('{"more": 1}\n')
    again = JobNotes(nodes=["n1", "n0"], token="second")  # the same name submitted anew
    assert job_log.event_log_dir(tmp_path, spec, fresh, again) == directory
    assert len((directory / "events.1.jsonl").read_text().splitlines()) == 2  # kept aside
    assert json.loads((directory / "events.jsonl").read_text())["nodes"] == ["n1", "n0"]
    other = JobSpec("b", "ns1", 2, 1)
    midway = dataclasses.replace(initial_status(other, None), seq=3, phase=Phase.RUN_COMMAND)
    assert job_log.event_log_dir(tmp_path, other, midway, JobNotes(token="t")) is None
    assert not (tmp_path / "ns1" / "b").exists()
    assert joblog.find_log_dir("a", tmp_path) == directory
    eventlog_writer.start_log(tmp_path / "ns2" / "a", JobSpec("a", "ns2", 1, 0), ["n"], 0.0, "t")
    with pytest.raises(joblog.LogDirError, match=r"several namespaces \(ns1, ns2\)"):
        joblog.find_log_dir("a", tmp_path)


def test_every_recovery_level_has_one_name_in_the_fault_log_and_in_incidents() -> None:
    """``aegis incidents`` had no name for a drain (a KeyError on the first drained node's
    eviction); both read the core's one table now."""
    from aegis.core import actions as act
    from aegis.core.model import PodName
    from aegis.core.recovery import LEVEL_NAMES, RecoveryLevel
    from aegis.tools import incidents as incidents_tool

    assert set(LEVEL_NAMES) == set(RecoveryLevel)
    drained = act.EvictPod(PodName("j-1"), RecoveryLevel.DRAIN, 0, "maintenance")
    note = incidents_tool.decision(drained)
    assert note is not None and note.level == "drained"
    assert Incident("j#1", 0.0, level=RecoveryLevel.DRAIN).level_name == "drained"


def test_status_prints_a_reason_with_brackets_as_it_is_not_as_markup() -> None:
    # A dying reason carries the traceback's last line; gloo's ends in "[/path/pair.cc:537]", which
    # rich read as a closing tag and `aegis status` exited 1 (a CI run on record).
    from aegis.cli import render, status_cmd
    from aegis.wire.job_summary import PodRow, Summary

    reason = "exit 1: RuntimeError: Connection closed by peer [/__w/gloo/tcp/pair.cc:537] [bold]x"
    pods = (PodRow("j-0", "node-0", "Running", 1, reason, watchdog="[red]300 s"),)
    summary = Summary("j", Phase.RUN_COMMAND, 3, 1, 0, False, ("[/n]",), pods, {})
    out = render.make_console()
    out.width = 200  # one line a row
    with out.capture() as captured:
        out.print(f"error nodes: {', '.join(summary.error_nodes)}")
        out.print(status_cmd.pod_table(summary))
    text = captured.get()
    assert "error nodes: [/n]" in text
    assert "[/__w/gloo/tcp/pair.cc:537]" in text and "[bold]x" in text and "[red]300 s" in text
