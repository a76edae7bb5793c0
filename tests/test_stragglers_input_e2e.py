"""A rank slow *before* the collective (a slow data loader) is named by its input time, which
step-end lateness cannot see: 4 gloo ranks of a script that never imports aegis
(tests/bin/slow_input_ddp.py), rank 2 sleeping before each forward; its peers wait for it in
DDP's all_reduce, so every rank ends each step together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aegis.core import stragglers
from aegis.core.phases import Phase
from aegis.master import metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.wire import messages as m
from tests.scrape import parse

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(300)]

SLOW_INPUT = str(Path(__file__).parent / "bin" / "slow_input_ddp.py")
SLOW_RANK = 2


async def test_a_rank_slow_before_the_collective_is_named_by_its_input_time(
    tmp_path: Path,
) -> None:
    # 20 ms of input on rank 2 against a period of about 35 ms: ~0.5 step, far above noise
    command = (sys.executable, SLOW_INPUT, "--steps", "700", "--step-time-s", "0.01",
               "--slow-rank", str(SLOW_RANK), "--slow-s", "0.02")  # fmt: skip
    settings = local_run.RunSettings(
        command=command, nodes=4, spare_nodes=0, max_retry=1, job="slowin", heartbeat_s=0.25,
        heartbeat_timeout_s=10.0, grace_s=3.0, log_dir=tmp_path / "logs",
    )  # fmt: skip
    hub = metrics.MasterMetrics()
    seen: dict[str, object] = {}
    inputs: dict[str, int] = {}  # pod -> heartbeats with an input time

    def listen(runner: JobRunner, platform: object) -> None:
        hub.attach(runner)
        runner.stragglers.settings = stragglers.StragglerSettings(window_s=2.0, min_samples=3)

        def on_heartbeat(r: JobRunner, msg: m.Message) -> None:
            beat = msg.data
            if isinstance(beat, m.HeartbeatData) and beat.input_s is not None:
                inputs[msg.pod] = inputs.get(msg.pod, 0) + 1
            watch = r.stragglers
            seen.setdefault("watch", watch)
            if watch.named is None or "named" in seen:
                return
            seen["named"] = watch.named
            seen["nodes"] = dict(r.pod_nodes())
            seen["end_alone"] = stragglers.straggler(tuple(watch.history), watch.settings)
            seen["end_scores"] = dict(watch.end_scores())
            seen["scores"] = dict(watch.scores())
            seen["exported"] = {
                dict(labels)["node"]: v
                for (name, labels), v in parse(hub.scrape()).items()
                if name == "aegis_straggler_score"
            }
            seen["naming"] = watch.naming(r.pod_nodes())

        runner.heartbeat_listeners.append(on_heartbeat)

    result = await local_run.run_local(settings, observe=listen)
    watch = seen.get("watch")
    assert "named" in seen, (
        result.status.phase,
        inputs,
        result.log_dir,
        getattr(watch, "input_history", None),
        getattr(watch, "history", None),
    )
    slow_pod = f"slowin-{SLOW_RANK}"
    named = seen["named"]
    assert isinstance(named, stragglers.Straggler)
    assert named.pod == slow_pod and named.signal == "input", named
    assert seen["end_alone"] is None, seen  # the step ends alone name nobody
    end_scores = seen["end_scores"]
    assert isinstance(end_scores, dict)
    assert abs(end_scores[slow_pod]) < 0.2, end_scores  # its steps end with its peers'
    exported = seen["exported"]
    assert isinstance(exported, dict)
    nodes = seen["nodes"]
    assert isinstance(nodes, dict)
    slow_node = nodes[slow_pod]
    assert max(exported, key=exported.__getitem__) == slow_node, exported
    print(f"named: {seen['naming']}; end scores {end_scores}; scores {seen['scores']}")
    assert f"straggler: {slow_node} (pod {slow_pod}" in str(seen["naming"])
    assert "later into its forward" in str(seen["naming"])
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert sorted(inputs) == [f"slowin-{i}" for i in range(4)], inputs
