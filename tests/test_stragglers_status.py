"""The straggler scores in ``aegis status``: the master stores them in the job record (written at
once when the pod named changes, with no other event), and the summary and the pod table show
each node's score and the straggler named."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from aegis.adapters import memory
from aegis.adapters.nats_bus import NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.cli import render, status_cmd
from aegis.core import stragglers
from aegis.core.model import JobSpec, NodeName, initial_status
from aegis.core.phases import Phase
from aegis.master.job_runner import JobRunner, JobSettings, status_key
from aegis.wire import job_summary
from aegis.wire import messages as m
from tests.runner_harness import Harness, RecordingPlatform, healthy, quit_input
from tests.waits import async_wait_until

PODS = ("job-0", "job-1", "job-2")


@pytest.fixture
async def three(tmp_path: Path) -> AsyncIterator[Harness]:
    """A job of three pods on a real nats-server (the store in memory)."""
    spec = JobSpec("job", "ns", len(PODS), 1)
    nodes = [NodeName(f"node-{i}") for i in range(len(PODS))]
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    bus: Any = await NatsBus.connect(server.url)
    store, platform = memory.MemoryStore(), RecordingPlatform()
    settings = JobSettings(heartbeat_timeout_s=5.0, order_resend_s=60)
    runner = JobRunner(spec, initial_status(spec, nodes), bus=bus, store=store,
                       platform=platform, settings=settings, log_dir=tmp_path)  # fmt: skip
    h = Harness(runner, bus, store, platform)
    await bus.subscribe(runner.master_subject, h.on_order)
    await runner.start([str(n) for n in nodes])
    h.task = asyncio.create_task(runner.run())
    yield h
    runner.done.set()
    runner.queue.put_nowait(quit_input(runner))
    await asyncio.wait_for(h.task, 5)
    await bus.close()
    await asyncio.to_thread(server.stop)


async def _running(h: Harness) -> None:
    for kind, data in ((m.MessageType.ACK, m.AckData()), (m.MessageType.FINISH, healthy())):
        for pod in PODS:
            await h.send(pod, kind, data)
        await h.settle()
    assert h.runner.status.phase is Phase.RUN_COMMAND


async def _record(h: Harness) -> dict[str, Any]:
    got = await h.store.get(status_key(h.runner.spec))
    assert got is not None
    record: dict[str, Any] = json.loads(got[0])
    return record


async def test_the_straggler_named_reaches_aegis_status_without_another_event(
    three: Harness,
) -> None:
    await _running(three)
    watch = three.runner.stragglers
    watch.settings = stragglers.StragglerSettings(window_s=0.05, min_samples=1)
    step, base = 0, time.monotonic()

    async def beats() -> bool:
        """One step of every pod: all end it together (a timeline of their own, 0.1 s a step),
        job-2 took 50 ms before its forward, its peers 5 ms."""
        nonlocal step
        step += 1
        for pod in PODS:
            took = 0.05 if pod == "job-2" else 0.005
            beat = m.HeartbeatData(step, "", base + 0.1 * step, time.monotonic(), took)
            await three.send(pod, m.MessageType.HEARTBEAT, beat)
        record = await _record(three)
        return record.get("stragglers", {}).get("named") == "job-2"

    await async_wait_until(beats, 30.0, "the straggler named in the stored record")
    record = await _record(three)
    summary = job_summary.from_record(record)
    assert summary.straggler.startswith("node-2 (pod job-2, "), summary.straggler
    assert "later into its forward" in summary.straggler
    scores = {row.node: row.straggler_score for row in summary.pods}
    assert set(scores) == {"node-0", "node-1", "node-2"}
    assert max(scores, key=lambda n: scores[n] or 0.0) == "node-2", scores
    assert summary.to_dict()["pods"][2]["straggler_score"] == scores["node-2"]
    table = status_cmd.pod_table(summary)
    assert [c.header for c in table.columns][-1] == "straggler score"
    out = render.make_console()
    out.width = 200
    with out.capture() as captured:
        out.print(table)
    assert "(straggler)" in captured.get()
    assert captured.get().count("(straggler)") == 1


def test_a_record_without_scores_shows_none_and_a_malformed_one_is_an_error() -> None:
    assert job_summary.straggler_scores(None) is None
    parsed = job_summary.straggler_scores({"scores": {"p-0": 0.5}, "named": "p-0", "why": "w"})
    assert parsed == job_summary.StragglerScores({"p-0": 0.5}, "p-0", "w")
    with pytest.raises(ValueError, match="stragglers: expected"):
        job_summary.straggler_scores([1, 2])
    with pytest.raises(ValueError, match="not a number"):
        job_summary.straggler_scores({"scores": {"p-0": "fast"}})
    row = job_summary.PodRow("p-0", "n-0", "Running", 0, "")
    summary = job_summary.Summary("j", Phase.RUN_COMMAND, 3, 0, 0, False, (), (row,), {})
    assert [c.header for c in status_cmd.pod_table(summary).columns][-1] == "last failure"


@pytest.mark.parametrize(("score", "shown"), [(-0.001, "0.00"), (-0.004, "0.00"),
                                              (-0.006, "-0.01"), (1.5, "1.50")])  # fmt: skip
def test_a_score_that_rounds_to_zero_shows_no_sign(score: float, shown: str) -> None:
    summary = job_summary.Summary("j", Phase.RUN_COMMAND, 1, 0, 0, False, (), (), {})
    row = job_summary.PodRow("j-0", "node-0", "RunCommand", 0, "", straggler_score=score)
    assert status_cmd.straggler_cell(summary, row) == shown  # (it showed "-0.00")
