"""A node cut off from the network, on the emulated cluster: its pod's heartbeats stop, the
pod is replaced on the same node, and the replacement's agent cannot reach the master either.
Before, the job waited in Restarting for ever (found by a chaos run: a 75 s partition left a
job there for ten minutes, and it never ended). Now a pod sent away that has not joined again
within ``--join-timeout-s`` has its node blacklisted and moves to a spare; the job succeeds,
with only the heartbeat loss counted."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from tests.cluster import holder_of, leftovers, probe, run_cluster
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def test_a_node_cut_off_for_good_loses_its_pod_to_a_spare(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = probe(out, str(tmp_path / "logs" / "checkpoints"), "--steps", "300",
                    "--step-time-s", "0.05")  # fmt: skip
    cut: list[int] = []

    async def partition(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        await async_wait_until((out / "rank-1.jsonl").exists, 120, "training on node-1")
        holder = holder_of(log_dir, "node-1")
        down = ["nsenter", f"--net=/proc/{holder}/ns/net", "ip", "link", "set", "eth0", "down"]
        subprocess.run(down, check=True, timeout=30)  # never brought up again
        cut.append(holder)

    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "p", "--join-timeout-s", "30"]
    run = await run_cluster(tmp_path, flags, command, during=partition, timeout_s=400)
    assert cut, run.output
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert [(e["node"], e["reason"]) for e in status["error_nodes"]] == [
        ("node-1", "did not come back within 30 s")
    ]
    assert run.pods["p-1"]["node"] == "spare-0"
    text = (run.log_dir / "faults.jsonl").read_text()
    assert "did not come back within 30 s: its node is blacklisted" in text
    assert leftovers(run.log_dir) == []


async def test_a_node_cut_off_for_a_while_gets_its_pod_back_once_it_is_reachable(
    tmp_path: Path,
) -> None:
    """The replacement on the cut-off node keeps trying to reach its master (``--rejoin``: it
    never runs the command on its own); once the link is back it joins, before the join
    timeout, and the job goes on on the same nodes. Before, it ran the command alone after
    its connect timeout (10 s), ended, and the pod came back only by the join timeout, on a
    spare (a 20 s partition cost 65 s)."""
    out = tmp_path / "out"
    command = probe(out, str(tmp_path / "logs" / "checkpoints"), "--steps", "300",
                    "--step-time-s", "0.05")  # fmt: skip

    async def blip(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        await async_wait_until((out / "rank-1.jsonl").exists, 120, "training on node-1")
        holder = holder_of(log_dir, "node-1")
        link = ["nsenter", f"--net=/proc/{holder}/ns/net", "ip", "link", "set", "eth0"]
        subprocess.run([*link, "down"], check=True, timeout=30)
        pod_log = log_dir / "pods" / "p-1.log"
        await async_wait_until(lambda: "this pod rejoins a running job" in pod_log.read_text(),
                               120, "the replacement trying again")  # fmt: skip
        subprocess.run([*link, "up"], check=True, timeout=30)

    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "p", "--join-timeout-s", "300"]
    run = await run_cluster(tmp_path, flags, command, during=blip, timeout_s=400)
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert status["error_nodes"] == [] and run.pods["p-1"]["node"] == "node-1", status
    assert "running the command independently" not in (run.log_dir / "pods" / "p-1.log").read_text()
    assert leftovers(run.log_dir) == []
