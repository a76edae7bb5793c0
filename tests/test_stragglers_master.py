"""The straggler scores in the master: heartbeats carry each pod's step end and send time on its
own clock, the job runner feeds them to its watch, the metrics export a score per node, and a
slowdown the pace watch reports names the straggler's node."""

from __future__ import annotations

import time

import pytest

from aegis.core import events as ev
from aegis.core import stragglers
from aegis.core.model import PodName
from aegis.core.phases import Order
from aegis.master import metrics
from aegis.master.pace import Pace
from aegis.wire import messages as m
from tests.jsonl import json_lines
from tests.runner_harness import Harness, to_running
from tests.scrape import parse
from tests.waits import async_wait_until

pytestmark = pytest.mark.timing  # the harness's pods are lost after 0.5 s of silence

CLOCKS = {"job-0": 1000.0, "job-1": -20.0}  # each pod's clock: the master's plus this


async def test_heartbeats_feed_the_scores_and_the_metrics_name_each_node(harness: Harness) -> None:
    hub = metrics.MasterMetrics()
    hub.attach(harness.runner)
    await to_running(harness)
    watch = harness.runner.stragglers
    watch.settings = stragglers.StragglerSettings(window_s=0.05, min_samples=1)
    step, base = 0, time.monotonic()

    async def beats() -> bool:
        """Every pod's beat of the next step: the steps end every 0.1 s (a timeline of their
        own, ahead of the beats, so no load on this machine changes it), job-1's half a step
        after job-0's; each beat says when it was sent on its pod's clock."""
        nonlocal step
        step += 1
        for pod, clock in CLOCKS.items():
            late = 0.05 if pod == "job-1" else 0.0
            ended = base + 0.1 * step + late + clock
            beat = m.HeartbeatData(step, "", ended, time.monotonic() + clock)
            await harness.send(pod, m.MessageType.HEARTBEAT, beat)
        return len(watch.history) >= 3

    await async_wait_until(beats, what="three straggler windows")
    assert set(watch.pods) == {PodName("job-0"), PodName("job-1")}
    # the offsets read each pod's clock back to the master's (within the transit time)
    for pod, clock in CLOCKS.items():
        offset = stragglers.clock_offset(watch.pods[PodName(pod)].beats)
        assert -clock <= offset < -clock + 1.0
    scores = watch.scores()
    assert scores["job-1"] - scores["job-0"] > 0.25, scores  # half a step, less the transit
    exported = {dict(labels)["node"]: v for (name, labels), v in parse(hub.scrape()).items()
                if name == "aegis_straggler_score"}  # fmt: skip
    assert set(exported) == {"node-0", "node-1"} and exported["node-1"] > exported["node-0"]


async def test_an_old_agent_without_step_times_only_feeds_the_pace(harness: Harness) -> None:
    await to_running(harness)
    for step in (1, 2, 3):
        await harness.send("job-0", m.MessageType.HEARTBEAT, m.HeartbeatData(step))
    await harness.settle()
    assert harness.runner.stragglers.pods == {}
    assert harness.runner.pace.steps[PodName("job-0")] == 3


class _Slowed(Pace):
    """A pace watch that has seen a slowdown (the pace itself is tests/test_pace.py's)."""

    def step_seen(self, seq: int, pod: PodName, step: int, now: float) -> str | None:
        return "3.00 steps/s, below 30% of this run's pace"


async def test_the_slowdown_report_names_the_straggler_node(harness: Harness) -> None:
    await to_running(harness)
    runner = harness.runner
    runner.progress.pace = _Slowed()
    runner.stragglers.seq = runner.status.seq
    runner.stragglers.named = stragglers.Straggler("job-1", 0.62, 5, 6)
    await harness.send("job-0", m.MessageType.HEARTBEAT, m.HeartbeatData(7))
    await harness.settle()
    await async_wait_until(lambda: "SlowdownReported" in _events(harness), what="the report")
    [reason] = [r["reason"] for r in _records(harness) if r["type"] == "SlowdownReported"]
    assert reason == (
        "3.00 steps/s, below 30% of this run's pace; straggler: node-1 (pod job-1, 0.62 steps "
        "behind its peers, late in 5 of the last 6 windows)"
    )


def _records(h: Harness) -> list[dict[str, object]]:
    log_dir = h.runner.events.path
    assert log_dir is not None
    return json_lines(log_dir)


def _events(h: Harness) -> list[object]:
    return [r["type"] for r in _records(h)]


async def test_a_troubleshooting_order_carries_no_raw_scores_when_nobody_is_named(
    harness: Harness,
) -> None:
    """allreduce_perf's tie-breaker gets only a straggler the robust rule named: two pods, one
    half a step late, have scores but no straggler (the rule needs a third to compare), and
    the troubleshooting order that stops training carries none (a raw score named a healthy
    pod in a round after an eviction, once)."""
    await to_running(harness)
    watch = harness.runner.stragglers
    watch.settings = stragglers.StragglerSettings(window_s=0.05, min_samples=1)
    step, base = 0, time.monotonic()

    async def beats() -> bool:
        nonlocal step
        step += 1
        for pod in CLOCKS:
            ended = base + 0.1 * step + (0.05 if pod == "job-1" else 0.0)
            await harness.send(
                pod, m.MessageType.HEARTBEAT, m.HeartbeatData(step, "", ended, time.monotonic())
            )
        return len(watch.history) >= 3

    await async_wait_until(beats, what="three straggler windows")
    assert watch.scores() and watch.named is None
    harness.runner.platform_event(ev.SlowdownReported("a test's slowdown"))

    def troubleshoot() -> m.OrderData | None:
        for msg in harness.orders:
            if isinstance(msg.data, m.OrderData) and msg.data.order is Order.TROUBLESHOOT:
                return msg.data
        return None

    await async_wait_until(lambda: troubleshoot() is not None, what="the troubleshooting order")
    order = troubleshoot()
    assert order is not None and m.HUNG_PODS_ENV in order.env
    assert m.STRAGGLER_SCORES_ENV not in order.env
