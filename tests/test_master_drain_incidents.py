"""``aegis incidents`` of a job with a drain eviction: the master's own event log (a job runner on
the in-memory bus: ``aegis ctl drain`` of a pod's node, the checkpoint every pod commits, the
pod leaving at level 5) read back by the tool, which names the level ``drained`` like the fault
log does (it once had no name for it: a KeyError on the first drained node's incident)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aegis.cli import main as cli
from aegis.core.model import PodName
from aegis.core.phases import Phase
from aegis.core.recovery import LEVEL_NAMES, RecoveryLevel
from aegis.master import faultlog
from aegis.wire import messages as m
from tests.runner_harness import Harness, to_running
from tests.waits import async_wait_until


async def test_aegis_incidents_of_a_run_with_a_drain_eviction_names_the_drain_level(
    harness: Harness,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    faults = faultlog.FaultLog(tmp_path / "faults.jsonl")
    faults.attach(harness.runner)
    await to_running(harness)
    harness.runner.drain((PodName("job-1"),), "kernel upgrade", 60.0)
    await harness.settle()
    for pod in ("job-0", "job-1"):
        await harness.send(pod, m.MessageType.CHECKPOINT, m.CheckpointData(5))
    await async_wait_until(lambda: ("evict", "job-1", "5") in harness.platform.calls,
                           what="the drained pod evicted at the commit")  # fmt: skip
    await harness.settle()
    assert harness.runner.status.phase is Phase.RESTARTING
    drained = LEVEL_NAMES[RecoveryLevel.DRAIN]
    assert drained == "drained"

    assert cli.main(["incidents", "job", "--log-dir", str(tmp_path), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    incident = next(i for i in found if i.get("kind") != "checkpoint_store_outage")
    assert incident["level"] == drained and not incident["counted"], incident
    assert incident["pod"] == "job-1" and "drain" in incident["detected_by"]
    assert any(d["level"] == drained for d in incident["decisions"]), incident
    assert cli.main(["incidents", "job", "--log-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"level 5 {drained}: " in text and f"level: {drained}" in text, text
    # the fault log names it the same
    lines = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert any(line["level"] == drained and line["pod"] == "job-1" for line in lines), lines
