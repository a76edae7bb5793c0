"""A node that turns slow during training (SIGSTOP/SIGCONT duty cycling from outside, from the
job's first committed checkpoint) slows the whole job down; the master's pace watch notices,
allreduce_perf names the node, which is marked and evicted only after the next committed
checkpoint; the job finishes elsewhere, with no fault counted."""

from __future__ import annotations

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


async def test_slow_node_is_evicted_after_the_next_checkpoint_commit(tmp_path: Path) -> None:
    settings = local_run.RunSettings(
        command=(
            sys.executable,
            str(TRAIN),
            "--steps",
            "900",
            "--ckpt-every",
            "300",
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
        pace_window_s=3.0,
        pace_drop=0.5,
    )
    hub = metrics.MasterMetrics()

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        hub.attach(runner)

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
    slowed = next(i for i, (t, _, _) in enumerate(kinds) if t == "SlowdownReported")
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
    # the master asked for that checkpoint (the periodic ones are every 300 steps): the slow
    # node left at the next step boundary, not at the next periodic checkpoint
    assert records[commit]["step"] % 300 != 0, records[commit]
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
