"""Straggler scores for a script that never imports aegis (tests/bin/plain_ddp.py: a torch
optimizer, gloo): the optimizer step hook's step times reach the master in the heartbeats,
every node gets a score in the metrics while the job trains, and a healthy job names nobody."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aegis.core.phases import Phase
from aegis.master import metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.wire import messages as m
from tests.scrape import parse

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(300)]

PLAIN_DDP = str(Path(__file__).parent / "bin" / "plain_ddp.py")


async def test_a_plain_script_gets_straggler_scores_and_a_healthy_one_names_nobody(
    tmp_path: Path,
) -> None:
    command = (sys.executable, PLAIN_DDP, "--steps", "600", "--ckpt-every", "100000",
               "--step-time-s", "0.02", "--ckpt-dir", str(tmp_path / "c"), "--quiet")  # fmt: skip
    # 3-s windows (the job is short) with beats 4 times a second: each figure is the median
    # of about 12 step ends, as a production window (10 s of 1-s beats) has about 10. With
    # 1-s beats a figure rests on 3 step ends, and under a 2-core hog scheduler delays in two
    # of them put a healthy rank 0.3 to 0.8 steps behind (measured: 22 of 123 such windows
    # late, against 0 of 145 with 12 samples; benchmarks/RESULTS.md)
    settings = local_run.RunSettings(
        command=command, nodes=3, spare_nodes=0, max_retry=1, job="plain", heartbeat_s=0.25,
        heartbeat_timeout_s=10.0, grace_s=3.0, log_dir=tmp_path / "logs",
    )  # fmt: skip
    hub = metrics.MasterMetrics()
    timed: dict[str, int] = {}  # pod -> heartbeats with a step time
    exported: dict[str, float] = {}  # node -> the last score scraped
    named: list[object] = []
    runners: list[JobRunner] = []

    def listen(runner: JobRunner, platform: object) -> None:
        hub.attach(runner)
        runners.append(runner)
        runner.stragglers.settings = type(runner.stragglers.settings)(window_s=3.0)

        def on_heartbeat(r: JobRunner, msg: m.Message) -> None:
            beat = msg.data
            if isinstance(beat, m.HeartbeatData) and beat.step_ts is not None:
                assert beat.sent_mono is not None and beat.step is not None
                timed[msg.pod] = timed.get(msg.pod, 0) + 1
            if r.stragglers.named is not None:
                named.append(r.stragglers.named)
            if r.stragglers.history:
                for (name, labels), v in parse(hub.scrape()).items():
                    if name == "aegis_straggler_score":
                        exported[dict(labels)["node"]] = v

        runner.heartbeat_listeners.append(on_heartbeat)

    result = await local_run.run_local(settings, observe=listen)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert sorted(timed) == ["plain-0", "plain-1", "plain-2"], timed
    assert min(timed.values()) >= 5, timed
    assert sorted(exported) == ["node-0", "node-1", "node-2"], exported
    assert runners[0].stragglers.history, "no straggler window was judged"
    watch = runners[0].stragglers
    # a healthy job has no straggler (on failure: each window's figures, to see why)
    assert named == [], (named, list(watch.history), list(watch.input_history))
