"""Draining a node before its GPU dies (seed 003): the agent's health watch reads its GPUs
through the real NVML reader (``RealNvml``, answered by ``fake_pynvml`` from recordings of real
GPUs) and says the warning signs; the master drains the pod's node (its own record of where the
pod runs), once, with no fault counted. The end-to-end run is in
``tests/test_health_drain_e2e.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aegis.agent import health
from aegis.checks import gpu, xids
from aegis.core import events as ev
from aegis.core.model import NodeName, PodName
from aegis.master import metrics, node_drains
from aegis.wire import codec
from aegis.wire import messages as m
from tests import fake_pynvml
from tests.core_helpers import Driver
from tests.jsonl import json_lines
from tests.runner_harness import Harness, RecordingPlatform, make_runner, running, to_running
from tests.scrape import parse, value
from tests.waits import async_wait_until, wait_until

DATA = Path(__file__).parent / "data"
PENDING = ["GPU 0: page retirement pending (1 DBE page(s))", "GPU 1: 87 C at/above slowdown 87 C"]


def _nvml(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``import pynvml`` gives the recording's GPUs (as on a node with that driver)."""
    raw = json.loads((DATA / name).read_text())
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.module(raw["snapshot"]))


# -- the master's decision ---------------------------------------------------------------------


def test_a_pods_warnings_drain_its_node_as_the_master_placed_it_once() -> None:
    job = Driver(workers=3)
    job.to_running()
    pod = job.pod(1)
    found = node_drains.health_drain(job.status, pod, m.HealthData(PENDING, "node-1"))
    assert found is not None
    assert (found.node, found.pods) == ("node-1", (pod,))
    assert found.reason.startswith("GPU health of node-1 (job-1): GPU 0: page retirement")
    said_nothing = m.HealthData(PENDING)  # an agent not told its node: the master's record
    assert node_drains.health_drain(job.status, pod, said_nothing) == found
    stale = m.HealthData(PENDING, "node-0")  # an agent of an earlier placement: refused
    assert node_drains.health_drain(job.status, pod, stale) is None
    assert node_drains.health_drain(job.status, PodName("job-9"), said_nothing) is None
    job.feed(ev.DrainRequested((pod,), found.reason))  # leaving already: nothing more to move
    assert node_drains.health_drain(job.status, pod, said_nothing) is None
    long = node_drains.health_drain(job.status, job.pod(2), m.HealthData(["x\n" * 400]))
    assert long is not None and "\n" not in long.reason
    assert len(long.reason) <= 2 * node_drains.REASON_CHARS + 80  # (escaped: a "\\n" is 2)


def test_a_node_in_error_nodes_is_not_drained_again() -> None:
    job = Driver(workers=3)
    job.to_running()
    job.feed(ev.NodeDown(NodeName("node-2"), "GPU health of node-2 (job-2): hot"))
    assert node_drains.health_drain(job.status, job.pod(2), m.HealthData(PENDING)) is None
    assert node_drains.health_drain(job.status, job.pod(1), m.HealthData(PENDING)) is not None


# -- the wire ----------------------------------------------------------------------------------


def _message(data: Any) -> bytes:
    msg = {"job": "job", "namespace": "ns", "pod": "job-1", "type": "Checkpoint",
           "phase": "RunCommand", "seq": 3, "ts": 0.0, "data": data}  # fmt: skip
    return json.dumps(msg).encode()


def test_a_health_report_goes_over_the_wire_and_bad_ones_are_refused() -> None:
    got = codec.decode(_message({"kind": "health", "warnings": PENDING}))
    assert got.data == m.HealthData(PENDING)
    for bad in ([], ["w"] * (m.HEALTH_WARNINGS + 1), ["x" * (m.SHORT_CHARS + 1)], [3]):
        with pytest.raises(codec.WireError):
            codec.decode(_message({"kind": "health", "warnings": bad}))
    assert msgspec.json.decode(codec.encode(codec.decode(_message(
        {"kind": "health", "warnings": PENDING}))))["data"]["kind"] == "health"  # fmt: skip


# -- the agent's watch -------------------------------------------------------------------------


class _Counting:
    """The real reader, its looks counted."""

    def __init__(self, reader: gpu.NvmlReader) -> None:
        self.reader, self.looks = reader, 0

    def read(self) -> gpu.GpuSnapshot | None:
        self.looks += 1
        return self.reader.read()


async def _watch(reader: gpu.NvmlReader, looks: int) -> list[list[str]]:
    """What the watch reports in ``looks`` looks (every 10 ms)."""
    reports: list[list[str]] = []
    counted = _Counting(reader)
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def report(warnings: list[str]) -> None:
        reports.append(warnings)

    watching = asyncio.create_task(health.watch(counted, report, 0.01, done))
    await async_wait_until(lambda: counted.looks >= looks or watching.done(), 60, "the looks")
    done.set_result(0)
    await asyncio.wait_for(watching, 30)
    return reports[: looks if counted.looks >= looks else None]


async def test_the_watch_says_a_nodes_warning_signs_at_each_look_while_they_stand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _nvml(monkeypatch, "nvml_v100_retired_pending.json")
    reports = await _watch(gpu.RealNvml(xid_wait_ms=0), looks=3)
    assert len(reports) >= 2 and all(r == PENDING for r in reports)  # (the last look may not)


async def test_the_watch_says_nothing_of_healthy_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _nvml(monkeypatch, "nvml_a100_healthy.json")
    assert await _watch(gpu.RealNvml(xid_wait_ms=0), looks=5) == []


class _Broken:
    def __init__(self, answer: gpu.GpuSnapshot | None = None, error: bool = False) -> None:
        self.answer, self.error, self.looks = answer, error, 0

    def read(self) -> gpu.GpuSnapshot | None:
        self.looks += 1
        if self.error:
            raise RuntimeError("NVML hung up")
        return self.answer


@pytest.mark.parametrize(("every_s", "looks"), [(1.0, 1), (0.0, 0)])
async def test_a_node_without_nvml_or_no_watch_end_it_quietly(every_s: float, looks: int) -> None:
    """No NVML: looked at once. ``--health-s 0``: not looked at."""
    reader = _Broken()
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def report(warnings: list[str]) -> None:
        raise AssertionError(warnings)

    await asyncio.wait_for(health.watch(reader, report, every_s, done), 30)
    assert reader.looks == looks and not done.done()


class _Scripted:
    """Answers in turn: a snapshot, None (NVML gone), or an exception; then the last again."""

    def __init__(self, answers: list[gpu.GpuSnapshot | Exception | None]) -> None:
        self.answers, self.looks = answers, 0

    def read(self) -> gpu.GpuSnapshot | None:
        answer = self.answers[min(self.looks, len(self.answers) - 1)]
        self.looks += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_a_first_look_that_fails_or_hangs_does_not_end_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU whose first NVML call fails, or hangs until it answers: before, the watch took
    it for a node without NVML and ended, and the warnings it then showed were never said."""
    monkeypatch.setattr(health, "LOOK_S", 0.05)
    raw = json.loads((DATA / "nvml_v100_retired_pending.json").read_text())
    pending = msgspec.convert(raw["snapshot"], gpu.GpuSnapshot)
    failing = _Scripted([RuntimeError("NVML: Unknown Error"), pending])
    reports = await _watch(failing, looks=3)  # (the last look may not have reported)
    assert reports and all(r == PENDING for r in reports) and failing.looks >= 3
    hanging = _Hanging(pending, hang_at=1)
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reports.clear()

    async def report(warnings: list[str]) -> None:
        reports.append(warnings)

    watching = asyncio.create_task(health.watch(hanging, report, 0.01, done))
    try:
        await async_wait_until(lambda: hanging.hung is not None, 60, "the first look hung")
        hanging.release.set()
        await async_wait_until(lambda: len(reports) >= 2 or watching.done(), 60, "two reports")
        assert not watching.done() and reports[:2] == [PENDING, PENDING]
    finally:
        hanging.release.set()
        done.set_result(0)
        await asyncio.wait_for(watching, 30)


async def test_once_nvml_answered_a_failed_look_does_not_end_the_watch() -> None:
    """A look that finds NVML gone (a driver reloading) or a reader error: before, the watch
    ended for good on it, and the GPU's warnings a look later were never said (the benchmark's
    run in which the warnings' recording was read half written drained nothing)."""
    raw = json.loads((DATA / "nvml_v100_retired_pending.json").read_text())
    pending = msgspec.convert(raw["snapshot"], gpu.GpuSnapshot)
    healthy = msgspec.convert(
        json.loads((DATA / "nvml_a100_healthy.json").read_text())["snapshot"], gpu.GpuSnapshot
    )
    reader = _Scripted([healthy, None, RuntimeError("NVML hung up"), pending])
    reports = await _watch(reader, looks=6)
    assert reports and all(r == PENDING for r in reports)
    assert reader.looks >= 6


class _Hanging:
    """A reader whose look number ``hang_at`` hangs until released (a GPU fallen off the
    bus); every look says the recording's warnings."""

    def __init__(self, answer: gpu.GpuSnapshot, hang_at: int) -> None:
        self.answer, self.hang_at, self.looks = answer, hang_at, 0
        self.release = threading.Event()
        self.hung: threading.Thread | None = None

    def read(self) -> gpu.GpuSnapshot | None:
        self.looks += 1
        if self.looks == self.hang_at:
            self.hung = threading.current_thread()
            self.release.wait(60)
        return self.answer


async def test_a_look_that_hangs_is_waited_for_never_doubled_and_never_holds_the_end(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a look ran in asyncio's executor, whose threads the loop's end waits for with
    no timeout (Python 3.11): an NVML call that hangs would have held the agent's exit."""
    monkeypatch.setattr(health, "LOOK_S", 0.05)
    raw = json.loads((DATA / "nvml_v100_retired_pending.json").read_text())
    reader = _Hanging(msgspec.convert(raw["snapshot"], gpu.GpuSnapshot), hang_at=2)
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reports: list[list[str]] = []

    async def report(warnings: list[str]) -> None:
        reports.append(warnings)

    with caplog.at_level(logging.INFO, logger="aegis.agent.health"):
        watching = asyncio.create_task(health.watch(reader, report, 0.01, done))
        await async_wait_until(lambda: "has not answered" in caplog.text or watching.done(), 60,
                               "the hung look logged")  # fmt: skip
        assert not watching.done() and reader.looks == 2  # waited for, not doubled
        look = reader.hung
        assert look is not None and look.daemon  # (the loop's end never waits for it)
        done.set_result(0)
        await asyncio.wait_for(watching, 30)  # ends while the look still hangs
        assert look.is_alive() and reader.looks == 2
        reader.release.set()
        look.join(30)
    assert reports == [PENDING] and "GPU health: GPU 0: page retirement" in caplog.text


def test_a_report_carries_at_most_its_bound_of_warnings_each_at_most_a_line() -> None:
    said = health.said([f"GPU {i}: " + "x" * 2000 for i in range(40)])
    assert len(said) == m.HEALTH_WARNINGS and all(len(w) == m.SHORT_CHARS for w in said)


# -- the master's shell ------------------------------------------------------------------------


async def test_the_master_drains_the_node_once_with_no_fault_counted(tmp_path: Path) -> None:
    """The node joins the job's ErrorNodes (the platform blacklists it: Slurm drains it too)
    and its pods are drained; the reports that go on while the pod moves change nothing."""
    from aegis.adapters import memory

    bus, store, platform = memory.MemoryBus(), memory.MemoryStore(), RecordingPlatform()
    runner = make_runner(tmp_path, bus, store, platform)
    hub = metrics.MasterMetrics()
    hub.attach(runner)
    async with running(Harness(runner, bus, store, platform)) as h:
        await to_running(h)
        for _ in range(3):  # said at each look while the warnings stand
            await h.send("job-1", m.MessageType.CHECKPOINT, m.HealthData(PENDING, "node-1"))
            await h.settle()
        assert runner.status.drain_count == 1 and runner.status.recover_count == 0
        assert [e.node for e in runner.status.error_nodes] == ["node-1"]
        assert platform.calls.count(("blacklist", "node-1")) == 1
        assert runner.drops.counts.get("health_other_node", 0) == 0
        stale = m.HealthData(["x"], "node-1")  # job-0 runs on node-0: not its node
        await h.send("job-0", m.MessageType.CHECKPOINT, stale)
        await h.settle()
        assert runner.status.drain_count == 1 and len(runner.status.error_nodes) == 1
        assert runner.drops.counts["health_other_node"] == 1  # refused, and counted
        samples = parse(hub.scrape())
        assert value(samples, "aegis_health_drains_total") == 1
        assert value(samples, "aegis_health_drains_total", node="node-1") == 1
        assert value(samples, "aegis_messages_dropped_total", reason="health_other_node") == 1
    events = json_lines(tmp_path / "events.jsonl")
    downs = [e for e in events if e["type"] == "NodeDown"]
    drains = [e for e in events if e["type"] == "DrainRequested"]
    assert [d["node"] for d in downs] == ["node-1"] and [d["pods"] for d in drains] == [["job-1"]]
    assert "page retirement pending" in drains[0]["reason"] == downs[0]["reason"]


# -- Xid events: heard between looks, the program's own no warning -----------------------------


def _healthy_a100(monkeypatch: pytest.MonkeyPatch) -> Any:
    raw = json.loads((DATA / "nvml_a100_healthy.json").read_text())
    fake = fake_pynvml.module(raw["snapshot"])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


async def test_an_xid_between_looks_is_said_at_the_next_look_and_the_programs_own_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, a look listened 100 ms for Xid events every 30 s: an Xid between looks (nearly
    all of them) was never heard. Now a listener keeps an event set registered from the first
    look: GPU 0 falls off the bus (Xid 79) and GPU 1 runs a program's illegal address (Xid 13)
    while no look runs; the next look says GPU 0's, and goes on saying it; GPU 1's is kept
    but is no warning sign. The listener frees its event set when stopped."""
    _healthy_a100(monkeypatch)
    before = fake_pynvml.open_event_sets()
    heard = xids.XidListener(wait_ms=20)
    reader = _Counting(gpu.RealNvml(listener=heard))
    done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reports: list[list[str]] = []

    async def report(warnings: list[str]) -> None:
        reports.append(warnings)

    watching = asyncio.create_task(health.watch(reader, report, 0.05, done))
    try:
        await async_wait_until(lambda: fake_pynvml.listening_to(0) and fake_pynvml.listening_to(1),
                               60, "the listener registered")  # fmt: skip
        assert reports == []
        assert gpu.RealNvml(xid_wait_ms=1).read() is not None  # a look of its own meanwhile
        assert fake_pynvml.xid(1, 13) == 1 and fake_pynvml.xid(0, 79) == 1  # only it hears
        looks = reader.looks
        await async_wait_until(lambda: len(reports) >= 2, 60, "two looks that say the Xid")
        assert reader.looks > looks
        assert all(r == ["GPU 0: critical Xid 79"] for r in reports), reports
        snapshot = reader.read()
        assert snapshot is not None
        assert [d.xid_events for d in snapshot.devices[:2]] == [[79], [13]]
    finally:
        done.set_result(0)
        await asyncio.wait_for(watching, 30)
        heard.stop(wait_s=30)
    assert not heard.listening() and fake_pynvml.open_event_sets() == before


def test_the_programs_own_xids_fail_no_gpu_check_and_a_hardware_one_does() -> None:
    raw = json.loads((DATA / "nvml_a100_healthy.json").read_text())
    healthy = msgspec.convert(raw["snapshot"], gpu.GpuSnapshot)

    def with_xids(codes: list[int]) -> gpu.GpuSnapshot:
        first = msgspec.structs.replace(healthy.devices[0], xid_events=codes)
        return msgspec.structs.replace(healthy, devices=[first, *healthy.devices[1:]])

    assert gpu.judge(with_xids([13, 31, 43, 45]), require_gpu=True, expected=None).passed
    assert gpu.health_warnings(with_xids([13, 31, 43, 45])) == []
    outcome = gpu.judge(with_xids([13, 48]), require_gpu=True, expected=None)
    assert not outcome.passed and "GPU 0: critical Xid 48" in outcome.result
    assert "13" not in outcome.result.split("critical Xid")[1]


def test_a_listener_that_stops_on_an_error_listens_again_at_a_later_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML's wait failing (not a timeout: a GPU lost, a driver reloading) ends the listener; a
    look ``retry_s`` after it started starts it again, with a new event set (the old one freed,
    NVML shut down as often as it was started). Before ``retry_s``, it is not started again (a
    listener that keeps failing is not started at every look)."""
    fake = _healthy_a100(monkeypatch)
    before = fake_pynvml.open_event_sets()
    wait, failures = fake.nvmlEventSetWait_v2, [fake_pynvml.NVMLError("GPU is lost")]

    def failing_once(event_set: str, timeout_ms: int) -> object:
        if failures:
            raise failures.pop()
        return wait(event_set, timeout_ms)

    monkeypatch.setattr(fake, "nvmlEventSetWait_v2", failing_once)
    heard = xids.XidListener(wait_ms=20, retry_s=3600)
    try:
        assert heard.heard(fake) == {}
        wait_until(lambda: not failures and not heard.listening(), 30, "the listener to stop")
        assert fake_pynvml.open_event_sets() == before  # freed on the way out
        heard.heard(fake)
        assert not heard.listening()  # (not before retry_s)
        heard.retry_s = 0.0
        heard.heard(fake)
        wait_until(lambda: fake_pynvml.listening_to(0) == 1, 30, "listening again")
        assert fake_pynvml.xid(0, 94) == 1
        wait_until(lambda: heard.heard(fake) == {0: [94]}, 30, "the Xid heard")
    finally:
        heard.stop(wait_s=30)
    assert not heard.listening() and fake_pynvml.open_event_sets() == before
    calls = fake.calls
    assert calls.count("init") == calls.count("shutdown") == 2  # (two listeners' own)


def test_a_gpu_that_takes_no_events_or_fell_off_the_bus_leaves_the_others_heard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU 1 refuses Xid events (Not Supported, as some boards): GPU 0's are heard all the
    same (before, one refusal ended the listener). Then GPU 1 falls off the bus: its handle
    fails (GPU is lost); the look still reads GPU 0, says GPU 1 unreachable, and says the Xid
    the listener heard (before, the look failed as a whole and nothing was said)."""
    fake = _healthy_a100(monkeypatch)
    register, lost = fake.nvmlDeviceRegisterEvents, set()

    def refusing(h: Any, types_: int, event_set: str) -> None:
        if h.index == 1:
            raise fake_pynvml.NVMLError(fake_pynvml.NOT_SUPPORTED)
        register(h, types_, event_set)

    handle = fake.nvmlDeviceGetHandleByIndex

    def maybe_lost(index: int) -> Any:
        if index in lost:
            raise fake_pynvml.NVMLError("GPU is lost")
        return handle(index)

    monkeypatch.setattr(fake, "nvmlDeviceRegisterEvents", refusing)
    monkeypatch.setattr(fake, "nvmlDeviceGetHandleByIndex", maybe_lost)
    heard = xids.XidListener(wait_ms=20)
    reader = gpu.RealNvml(listener=heard)
    try:
        assert gpu.health_warnings(reader.read()) == []
        wait_until(lambda: fake_pynvml.listening_to(0) == 1, 30, "GPU 0 heard")
        assert fake_pynvml.listening_to(1) == 0
        assert fake_pynvml.xid(1, 79) == 0 and fake_pynvml.xid(0, 79) == 1
        wait_until(lambda: heard.heard(fake) == {0: [79]}, 30, "the Xid heard")
        lost.add(1)
        snapshot = reader.read()
    finally:
        heard.stop(wait_s=30)
    assert snapshot is not None and snapshot.devices[0].name != "?"
    assert gpu.health_warnings(snapshot) == [
        "GPU 0: critical Xid 79",
        "GPU 1: unreachable (NVMLError: GPU is lost)",
    ]
