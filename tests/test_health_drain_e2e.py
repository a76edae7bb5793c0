"""A node whose GPU shows warning signs is drained before the GPU fails (seed 003), on the
emulated cluster, with a script that never imports aegis.

The agents read their GPUs through the real NVML reader; ``tests/bin/nvml/pynvml.py`` stands in
for the NVIDIA library and answers from recordings of real GPUs, per node (its hostname). While
the job trains, node-1's GPUs start to show a double-bit ECC page pending retirement and a GPU
at its slowdown temperature (the V100 recording): node-1's agent says so at its next look, the
master drains node-1, its pod moves to the spare, and the job goes on to succeed with no fault
counted. Before, nothing looked at the GPUs between check rounds: the job trained on until the
GPU failed, then lost the work since its last checkpoint and a fault of its budget. The other
sign: GPU 0 of node-1 has the program's Xid 13 (nothing) and then Xid 79 (fallen off the bus)
between two looks; the agent's listener hears it (before, a look listened 100 ms and did not).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.cluster import last_step, plain_ddp, run_cluster
from tests.jsonl import json_lines
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NVML = Path(__file__).parent / "bin" / "nvml"
FAILING = Path(__file__).parent / "data" / "nvml_v100_retired_pending.json"


def _drains(log_dir: Path) -> list[dict[str, object]]:
    path = log_dir / "events.jsonl"
    events = json_lines(path) if path.exists() else []
    return [e for e in events if e["type"] == "DrainRequested"]


# what turns node-1 bad: its GPUs' readings (a recording), or an Xid event between two looks
# (GPU 0 fallen off the bus, heard by the agent's listener: a look's own 100 ms never heard it)
SIGNS = {
    "readings": (
        "GPU 0: page retirement pending (1 DBE page(s))",
        "GPU 1: 87 C at/above slowdown 87 C",
    ),
    "xid": ("GPU 0: critical Xid 79",),
}


@pytest.mark.parametrize("sign", sorted(SIGNS))
async def test_a_node_whose_gpu_shows_warning_signs_is_drained_before_it_fails(
    tmp_path: Path, sign: str
) -> None:
    gpus = tmp_path / "gpus"  # <node>.json: that node's GPUs (none: healthy A100s)
    gpus.mkdir()

    async def scenario(proc: object, log_dir: Path) -> None:
        del proc
        pod_log = log_dir / "pods" / "h-1.log"
        await async_wait_until(lambda: last_step(pod_log, 1) >= 30, 300, "training")
        if sign == "xid":
            (gpus / "node-1.xids").write_text("0 13\n0 79\n")  # the program's, then the GPU's
        else:
            shutil.copy(FAILING, gpus / "node-1.tmp")
            (gpus / "node-1.tmp").rename(gpus / "node-1.json")  # (never read half written)
        await async_wait_until(lambda: _drains(log_dir), 120, "node-1 drained")

    command = plain_ddp(tmp_path / "ckpt", steps=400)
    run = await run_cluster(
        tmp_path,
        ["--nodes", "2", "--spare-nodes", "1", "--job", "h", "--health-s", "1"],
        command,
        during=scenario,
        timeout_s=540,
        env={"PYTHONPATH": str(NVML), "AEGIS_TEST_NVML": str(gpus)},
    )
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert (status["phase"], status["recover_count"]) == ("Succeed", 0)
    assert (run.pods["h-0"]["node"], run.pods["h-1"]["node"]) == ("node-0", "spare-0")
    [drain] = _drains(run.log_dir)
    assert drain["pods"] == ["h-1"], drain
    reason = str(drain["reason"])
    assert reason == "GPU health of node-1 (h-1): " + "; ".join(SIGNS[sign]), reason
    agent_log = (run.log_dir / "pods" / "h-1.log").read_text()
    assert f"GPU health: {SIGNS[sign][0]}" in agent_log
    events = json_lines(run.log_dir / "events.jsonl")
    assert not [e for e in events if e["type"] in ("PodErrored", "HangReported", "HeartbeatLost")]
    [down] = [e for e in events if e["type"] == "NodeDown"]  # the job's ErrorNodes: kept out
    assert (down["node"], down["reason"]) == ("node-1", reason)
    assert [e["node"] for e in status["error_nodes"]] == ["node-1"]
