"""A node that turns slow during training (SIGSTOP/SIGCONT duty cycling from outside, from the
job's first committed checkpoint) slows the whole job down; the master's pace watch notices,
allreduce_perf names the node, which is marked and evicted only after the next committed
checkpoint; the job finishes elsewhere, with no fault counted.

It must hold on a loaded machine (issue 18: run 10 times while other processes keep both cores
busy): no slowdown is reported before the node turned slow, exactly one after, and the slow
node is evicted every time. What makes that hold:

- the training steps are CPU-bound (no sleep in the step): a stopped rank stops the job. With
  the 10-ms sleep of ``train_ddp.py``'s default a rank stopped 80% of the time caught up in its
  sleeps and the job only halved its pace, less on a loaded machine (where the platform's scan
  of ``/proc`` and its late wake-ups lengthen the running part of each period): what a
  machine loaded by another job also does, and a drop that must be below 50% fired on load or
  missed the node;
- the node is stopped 0.4 s of every 0.5 s (80%, as the platform's default, but in spells much
  longer than the platform's scan of ``/proc`` and its wake-ups, 20-50 ms on a loaded machine:
  at 0.16 s of 0.2 s a machine loaded by other jobs left the job at its healthy pace half of
  the time); allreduce_perf's 0.3-s rounds, each started while the node runs, then see a stop;
- the drop must stay below 40% of the run's pace for three windows of 5 s;
- every start is cold (``AEGIS_PREWARM=0``): on this 2-core machine the zygotes that three pods
  make right after their first steps (importing torch, and here failing and retrying three
  times each) cut the job's pace to a tenth for more than 10 s, which a loaded run reported as
  a slowdown before the node had turned slow (recorded in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.master import metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform
from tests.scrape import parse, value

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


async def test_slow_node_is_evicted_after_the_next_checkpoint_commit(tmp_path: Path) -> None:
    settings = local_run.RunSettings(
        command=(
            sys.executable,
            str(TRAIN),
            "--steps",
            "3000",
            "--ckpt-every",
            "1500",
            "--step-time-s",
            "0",
            "--ckpt-dir",
            str(tmp_path / "ckpt"),
        ),
        nodes=3,
        spare_nodes=1,
        max_retry=2,
        job="slow",
        heartbeat_timeout_s=10.0,
        grace_s=3.0,
        log_dir=tmp_path / "logs",
        inject={"node-1": frozenset({"slow"})},
        pace_window_s=5.0,
        pace_drop=0.4,
    )
    hub = metrics.MasterMetrics()

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        hub.attach(runner)
        platform.settings = dataclasses.replace(platform.settings, prewarm="0")

    result = await local_run.run_local(settings, observe=observe)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert [e.node for e in result.status.error_nodes] == ["node-1"]
    assert "slow" in result.status.error_nodes[0].reason
    assert result.status.pod_infos["slow-1"].node == "spare-0"  # type: ignore[index]
    assert result.status.recover_count == 0  # a slow node is no fault
    records = [
        json.loads(line) for line in (result.log_dir / "events.jsonl").read_text().splitlines()
    ]
    kinds = [(r["type"], r.get("pod"), r.get("phase")) for r in records]
    # order of events: the first commit (node-1 turns slow), the pace watch's report, the
    # troubleshooting answers name the slow pod, training restarts in place, then a checkpoint
    # is committed by every pod, and only then is the slow pod replaced
    first_commit = kinds.index(("CheckpointCommitted", None, None))
    slowdowns = [i for i, (t, _, _) in enumerate(kinds) if t == "SlowdownReported"]
    assert len(slowdowns) == 1, [records[i]["reason"] for i in slowdowns]  # no false round
    slowed = slowdowns[0]
    assert "steps/s" in records[slowed]["reason"], records[slowed]
    slow_answer = next(
        i
        for i, r in enumerate(records)
        if r["type"] == "Finish"
        and r["phase"] == "Troubleshooting"
        and r["pod"] == "slow-1"
        and any(
            c["check_type"] == "allreduce_perf" and not c["passed"]
            for c in r["data"]["response"]["results"]
        )
    )
    commit = next(
        i for i, (t, _, _) in enumerate(kinds) if t == "CheckpointCommitted" and i > slow_answer
    )
    replaced = next(
        i
        for i, r in enumerate(records)
        if r["type"] == "PodRestarted" and r["pod"] == "slow-1" and r["node"] == "spare-0"
    )
    assert first_commit < slowed < slow_answer < commit < replaced
    # the master asked for that checkpoint (the periodic ones are every 1500 steps): the slow
    # node left at the next step boundary, not at the next periodic checkpoint
    assert records[commit]["step"] % 1500 != 0, records[commit]
    # no fault: one recovery, the eviction
    samples = parse(hub.scrape())
    assert value(samples, "aegis_recoveries_total", level="slow_evicted") == 1
    assert value(samples, "aegis_recovery_duration_seconds_count", level="slow_evicted") == 1
    assert value(samples, "aegis_recoveries_total", level="node_replaced") == 0
    assert value(samples, "aegis_faults_total", counted="true") == 0
    # the incidents: the slowdown (no fault; the checks' evidence names the node), then the
    # eviction at the checkpoint
    out = subprocess.run(
        [sys.executable, "-m", "aegis", "incidents", "slow", "--log-dir", str(result.log_dir),
         "--json"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    slowdown, evicted = json.loads(out.stdout)
    assert slowdown["detected_by"].startswith("pace watch: ") and not slowdown["counted"]
    assert slowdown["classification"]["slow-1"] == "slow" and slowdown["level"] is None
    assert any("allreduce_perf: FAIL" in line for e in slowdown["evidence"] for line in e["lines"])
    assert evicted["level"] == "slow_evicted" and evicted["pod"] == "slow-1"
