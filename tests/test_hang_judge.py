"""The master judges a hang from every pod's report of it (``master.hang_judge``), on a real
``JobRunner`` (in-memory bus): the pod that is not where the others are is blamed, whichever
watchdog fired first; none is blamed when the stacks single none out; ``aegis ctl hang`` names
its pod at once. What the runner decided is in ``events.jsonl`` and replays identically."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_auth import worker_subject
from aegis.cli import status_cmd
from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName, PodName, initial_status
from aegis.core.phases import Phase
from aegis.master import control, metrics
from aegis.master.hang_judge import GatherSettings
from aegis.master.job_runner import JobRunner, JobSettings, status_key
from aegis.master.ports import NullPlatform
from aegis.tools import incidents, replay
from aegis.wire import codec, job_summary
from aegis.wire import messages as m
from aegis.wire.translate import TEXT_CHARS
from tests.runner_harness import healthy
from tests.test_suspects import ASLEEP, WAITING
from tests.waits import async_wait_until

pytestmark = pytest.mark.timing

PODS = ("job-0", "job-1", "job-2")


@dataclass
class Job:
    runner: JobRunner
    bus: memory.MemoryBus
    log: Path

    async def send(self, pod: str, kind: m.MessageType, data: m.Payload, ident: str) -> None:
        s = self.runner.status
        msg = m.Message(job="job", namespace="ns", pod=pod, type=kind, phase=s.phase, seq=s.seq,
                        ts=0.0, data=data, id=ident)  # fmt: skip
        await self.bus.publish(worker_subject(self.runner.prefix, pod), codec.encode(msg))

    async def hang(self, pod: str, stacks: str) -> None:
        data = m.HangData(31.0, stacks, 30.0, "10 x p99 step 0.05 s = 0.5 s, floor 30 s")
        await self.send(pod, m.MessageType.HANG, data, f"{pod}/hang")


@pytest.fixture
async def job(tmp_path: Path) -> AsyncIterator[Job]:
    spec = JobSpec("job", "ns", 3, 3)
    nodes = [NodeName(f"node-{i}") for i in range(3)]
    settings = JobSettings(heartbeat_timeout_s=60, order_resend_s=60,
                           hang_gather=GatherSettings(min_s=0.5, max_s=0.5))  # fmt: skip
    bus = memory.MemoryBus()
    runner = JobRunner(spec, initial_status(spec, nodes), bus=bus, store=memory.MemoryStore(),
                       platform=NullPlatform(), settings=settings, log_dir=tmp_path)  # fmt: skip
    await runner.start([str(n) for n in nodes])
    task = asyncio.create_task(runner.run())
    it = Job(runner, bus, tmp_path / "events.jsonl")
    rounds = ((m.MessageType.ACK, m.AckData(), Phase.BOOT_CHECKING),
              (m.MessageType.FINISH, healthy(), Phase.RUN_COMMAND))  # fmt: skip
    for kind, data, phase in rounds:
        for pod in PODS:
            await it.send(pod, kind, data, f"{pod}/{kind}")
        await async_wait_until(lambda p=phase: runner.status.phase is p, what=str(phase))
    yield it
    runner.close()
    await asyncio.wait_for(task, 10)


async def _troubleshooting(job: Job) -> None:
    await async_wait_until(
        lambda: job.runner.status.phase is Phase.TROUBLESHOOTING, what="the hang handled"
    )


def _replayed(job: Job) -> list[incidents.Incident]:
    spec, initial, steps = replay.replay(job.log.read_text().splitlines())
    done = list(steps)
    assert done[-1].status == job.runner.status  # the same decisions, replayed
    return incidents.incidents(spec.job, initial, done)


async def test_the_pod_elsewhere_is_blamed_not_the_first_to_report(job: Job) -> None:
    hub = metrics.MasterMetrics()
    hub.attach(job.runner)
    for pod, stacks in (("job-2", WAITING), ("job-0", WAITING), ("job-1", ASLEEP)):
        await job.hang(pod, stacks)  # job-2's watchdog fired first
    await _troubleshooting(job)
    infos = job.runner.status.pod_infos
    assert [p for p in PODS if infos[PodName(p)].slow] == ["job-1"]
    reason = infos[PodName("job-1")].last_failed_reason
    assert "suspect: job-1 (rank 1, node node-1): in stuck_forever (train.py)" in reason
    assert "timeout 30 s: 10 x p99 step" in reason
    suspects = hub.registry.get_sample_value("aegis_hang_suspects_total", {"node": "node-1"})
    assert suspects == 1
    hang = hub.registry.get_sample_value("aegis_faults_total", {"detector": "hang",
                                                                "counted": "true"})  # fmt: skip
    assert hang == 1
    [incident] = _replayed(job)
    assert incident.pod == "job-1" and incident.suspect.startswith("job-1 (rank 1, node node-1)")
    assert sorted(e.pod for e in incident.evidence if e.kind == "stacks") == list(PODS)


async def test_the_one_pod_that_never_reported_is_named_when_the_window_closes(job: Job) -> None:
    await job.hang("job-0", WAITING)
    await job.hang("job-2", WAITING)
    await _troubleshooting(job)  # after the 0.5 s window: job-1 never said it was hung
    infos = job.runner.status.pod_infos
    assert [p for p in PODS if infos[PodName(p)].slow] == ["job-1"]
    assert "suspect: job-1 (rank 1, node node-1): reported no hang while 2 other pods" in (
        infos[PodName("job-1")].last_failed_reason
    )
    assert job.runner.status.recover_count == 1


async def test_nobody_is_marked_slow_when_the_stacks_single_none_out(job: Job) -> None:
    hub = metrics.MasterMetrics()
    hub.attach(job.runner)
    for pod in PODS:
        await job.hang(pod, WAITING)
    await _troubleshooting(job)
    status = job.runner.status
    assert not any(info.slow for info in status.pod_infos.values())
    assert status.recover_count == 1  # counted all the same
    assert hub.registry.get_sample_value("aegis_hang_suspects_total", {"node": "none"}) == 1
    [incident] = _replayed(job)
    assert incident.suspect == "" and "no suspect" in incident.reason


async def test_a_report_with_an_absurd_flight_count_does_not_lose_the_rounds_hang(
    job: Job,
) -> None:
    """One pod's stacks with a flight count of 5,000 digits: the hang is judged all the same
    (it raised while judging, after the held reports were let go: the hang was never handled)."""
    absurd = f"{WAITING}\nflight recorder: collective #{'9' * 5000} enqueued, #0 completed"
    for pod, stacks in (("job-0", absurd), ("job-1", ASLEEP), ("job-2", WAITING)):
        await job.hang(pod, stacks)
    await _troubleshooting(job)
    infos = job.runner.status.pod_infos
    assert [p for p in PODS if infos[PodName(p)].slow] == ["job-1"]


async def test_a_frame_name_from_a_peers_stacks_is_cut_in_the_record(job: Job) -> None:
    """The suspect's frame is a peer's text: the reason the record keeps is at most
    TEXT_CHARS (like an error's), so one hang report cannot fill the job's record."""
    elsewhere = ASLEEP.replace("stuck_forever", "f" * 200_000)
    for pod, stacks in (("job-0", WAITING), ("job-1", elsewhere), ("job-2", WAITING)):
        await job.hang(pod, stacks)
    await _troubleshooting(job)
    reason = job.runner.status.pod_infos[PodName("job-1")].last_failed_reason
    assert "suspect: job-1 (rank 1, node node-1): in fff" in reason
    assert len(reason) <= TEXT_CHARS + 100, len(reason)
    [judged] = [json.loads(line) for line in job.log.read_text().splitlines()
                if '"HangJudged"' in line]  # fmt: skip
    assert judged["suspect_why"].startswith("in fff") and len(judged["suspect_why"]) == TEXT_CHARS


async def test_aegis_ctl_hang_names_its_pod_at_once(job: Job) -> None:
    await control._feed_hang(job.runner, "job-2")
    await _troubleshooting(job)
    infos = job.runner.status.pod_infos
    assert [p for p in PODS if infos[PodName(p)].slow] == ["job-2"]
    [incident] = _replayed(job)
    assert incident.suspect == "job-2 (rank 2, node node-2): named by the operator"


async def test_a_second_report_of_the_same_pod_and_a_stale_one_are_not_held_twice(
    job: Job,
) -> None:
    await job.hang("job-0", WAITING)
    await job.hang("job-0", WAITING)  # the agent's resend: same id
    await async_wait_until(lambda: job.runner.drops.counts["duplicate_id"] == 1, what="dup")
    s = job.runner.status
    stale = m.Message(job="job", namespace="ns", pod="job-1", type=m.MessageType.HANG,
                      phase=s.phase, seq=s.seq - 1, ts=0.0, data=m.HangData(40.0, ASLEEP),
                      id="job-1/stale")  # fmt: skip
    await job.runner.on_worker_message(worker_subject(job.runner.prefix, "job-1"),
                                       codec.encode(stale))  # fmt: skip
    assert list(job.runner.hang_window.judge.held) == ["job-0"]  # the stale one went to the core
    await _troubleshooting(job)
    assert not any(info.slow for info in job.runner.status.pod_infos.values())


async def test_each_pods_watchdog_choice_reaches_aegis_status(job: Job) -> None:
    said = "30 s (10 x p99 step 0.05 s = 0.5 s, floor 30 s)"
    await job.send("job-0", m.MessageType.HEARTBEAT, m.HeartbeatData(7, said), "job-0/hb")
    await async_wait_until(lambda: bool(job.runner.notes.watchdogs), what="the heartbeat")
    job.runner.platform_event(ev.SlowdownReported("a write of the status"))

    async def stored() -> bool:
        got = await job.runner.store.get(status_key(job.runner.spec))
        return got is not None and "watchdogs" in json.loads(got[0])

    await async_wait_until(stored, what="the status written with it")
    got = await job.runner.store.get(status_key(job.runner.spec))
    assert got is not None
    record = json.loads(got[0])
    summary = job_summary.from_record(record)
    assert [row.watchdog for row in summary.pods] == [said, "", ""]
    table = status_cmd.pod_table(summary)
    assert [c.header for c in table.columns][-1] == "hang watchdog"
    assert summary.to_dict()["pods"][0]["watchdog"] == said


# -- no step signal: the reporters may wait for a pod still at work ----------------------------

QUIET_WHY = "no step signal: 60 s with no output and no CPU use"


def _quiet() -> m.HangData:
    return m.HangData(61.0, WAITING, 60.0, QUIET_WHY, no_step_signal=True)


async def test_reports_with_no_step_signal_wait_for_the_pod_still_at_work(
    job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 prepares data while the others wait at a barrier, before any step: their
    watchdogs see no output and no CPU, and report. That is no hang while rank 0 works: the
    window waits on; once rank 0 stalls too (every pod reported), the hang is judged."""
    caplog.set_level("WARNING", logger="aegis.master.hang_window")
    for pod in ("job-1", "job-2"):
        await job.send(pod, m.MessageType.HANG, _quiet(), f"{pod}/hang")
    await async_wait_until(lambda: "wait for job-0, still at work" in caplog.text, what="held")
    assert job.runner.status.phase is Phase.RUN_COMMAND
    assert sorted(job.runner.hang_window.judge.held) == ["job-1", "job-2"]
    await job.send("job-0", m.MessageType.HANG, _quiet(), "job-0/hang")
    await _troubleshooting(job)
    [incident] = _replayed(job)
    assert sorted(e.pod for e in incident.evidence if e.kind == "stacks") == list(PODS)


async def test_a_pod_at_work_longer_than_work_s_is_judged(job: Job) -> None:
    """A pod at work while all the others wait, for longer than ``work_s`` (600 s by default,
    NCCL's collective timeout): the hang is judged, the pod that did not report blamed."""
    job.runner.hang_window.judge.settings = GatherSettings(min_s=0.5, max_s=0.5, work_s=1.0)
    for pod in ("job-1", "job-2"):
        await job.send(pod, m.MessageType.HANG, _quiet(), f"{pod}/hang")
    await _troubleshooting(job)
    reason = job.runner.status.pod_infos[PodName("job-0")].last_failed_reason
    assert "suspect: job-0" in reason and "reported no hang" in reason


def _message(pod: str, data: m.Payload, seq: int, kind: m.MessageType) -> m.Message:
    return m.Message(job="job", namespace="ns", pod=pod, type=kind, phase=Phase.RUN_COMMAND,
                     seq=seq, ts=0.0, data=data, id=f"{pod}/{kind}")  # fmt: skip


def test_a_report_is_withdrawn_when_its_pods_training_moves_again() -> None:
    """(Pure.) A pod's heartbeats told its hang, then that it moved again: its held report is
    withdrawn; a pod whose beats never told a hang (an agent of an earlier version) withdraws
    nothing; a beat of another round withdraws nothing."""
    from aegis.master.hang_judge import HangJudge
    from tests.core_helpers import Driver

    driver = Driver(workers=3)
    driver.to_running()
    status, seq = driver.status, driver.status.seq
    pods = [str(p) for p in driver.pods]
    judge = HangJudge(GatherSettings(min_s=0.5, max_s=0.5))
    beat = m.MessageType.HEARTBEAT

    def told(pod: str, hung: bool, at: int = seq) -> bool:
        return judge.withdraw(status, _message(pod, m.HeartbeatData(hung=hung), at, beat))

    assert not told(pods[1], True)
    assert judge.hold(status, _message(pods[1], _quiet(), seq, m.MessageType.HANG)) == 0.5
    assert judge.hold(status, _message(pods[2], _quiet(), seq, m.MessageType.HANG)) is None
    assert judge.waits_for_work(status) == [driver.pods[0]]
    assert not told(pods[2], False)  # never told a hang: an earlier agent's beat
    assert not told(pods[1], False, at=seq - 1)  # another round's
    assert told(pods[1], False)
    assert list(judge.held) == [pods[2]]
    assert not told(pods[1], False)  # withdrawn once
    # reports judged on steps are judged at the window's close, whoever did not report
    stepped = HangJudge(GatherSettings(min_s=0.5, max_s=0.5))
    data = m.HangData(31.0, WAITING, 30.0, "10 x p99 step 0.05 s = 0.5 s, floor 30 s")
    stepped.hold(status, _message(pods[1], data, seq, m.MessageType.HANG))
    assert stepped.waits_for_work(status) == []


def test_the_wait_for_work_counts_from_the_rounds_first_wait_across_withdrawals() -> None:
    """(Pure.) A waiting rank that prints now and then withdraws its report and reports again:
    the wait still ends ``work_s`` after the round's reports first waited, not after the last
    report (a pod at work forever is judged in the end)."""
    from aegis.master.hang_judge import HangJudge
    from tests.core_helpers import Driver

    driver = Driver(workers=3)
    driver.to_running()
    status, seq = driver.status, driver.status.seq
    pod = str(driver.pods[1])
    judge = HangJudge(GatherSettings(min_s=0.5, max_s=0.5, work_s=600.0))
    beat, hang = m.MessageType.HEARTBEAT, m.MessageType.HANG
    judge.withdraw(status, _message(pod, m.HeartbeatData(hung=True), seq, beat))
    judge.hold(status, _message(pod, _quiet(), seq, hang))
    assert judge.wait_left(status, now=100.0) == 600.0 and judge.waiting
    assert judge.withdraw(status, _message(pod, m.HeartbeatData(hung=False), seq, beat))
    assert not judge.waiting and not judge.held
    judge.withdraw(status, _message(pod, m.HeartbeatData(hung=True), seq, beat))
    assert judge.hold(status, _message(pod, _quiet(), seq, hang)) == 0.5  # a new window
    assert judge.wait_left(status, now=400.0) == 300.0
    assert judge.wait_left(status, now=700.0) == 0.0


async def test_reports_waiting_for_a_pod_that_finished_are_judged_at_the_next_beat(
    job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    """The pod the others waited for ended its training (exit 0) and left them waiting: no
    pod is at work any more, so the next heartbeat has the hang judged, not the end of
    ``work_s``."""
    caplog.set_level("WARNING", logger="aegis.master.hang_window")
    for pod in ("job-1", "job-2"):
        await job.send(pod, m.MessageType.HEARTBEAT, m.HeartbeatData(hung=True), f"{pod}/hb")
        await job.send(pod, m.MessageType.HANG, _quiet(), f"{pod}/hang")
    await async_wait_until(lambda: "wait for job-0, still at work" in caplog.text, what="held")
    await job.send("job-0", m.MessageType.FINISH, m.ExitData(0), "job-0/finish")
    await async_wait_until(lambda: job.runner.status.pod_infos[PodName("job-0")].finished,
                           what="job-0 finished")  # fmt: skip
    assert job.runner.status.phase is Phase.RUN_COMMAND
    await job.send("job-1", m.MessageType.HEARTBEAT, m.HeartbeatData(hung=True), "job-1/hb2")
    await _troubleshooting(job)
    [judged] = [r for r in map(json.loads, job.log.read_text().splitlines())
                if r["type"] == "HangJudged"]  # fmt: skip
    assert sorted(report["pod"] for report in judged["reports"]) == ["job-1", "job-2"]
