"""A node that dies, on the emulated cluster: every process in node-1's namespaces is killed
at once (its agent, the training, the checks' forkserver, and the holder of its namespaces, as
a host that loses power). The heartbeats stop; the pod is lost, counted once, and placed on the
spare at once, for the platform knows the node is down; the node joins the job's error nodes
(the platform tells the master, which records it in the event log). Before, the local platform
placed the pod on its dead node again (a lost pod comes back on its node), where ``nsenter``
could not enter the namespaces, and the job waited idle for the whole join timeout (60 s under
``aegis run``, found by a chaos run) before the pod moved; and after it moved, the run's
summary said "error nodes: none". The training script never imports aegis."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from tests.cluster import (
    holder_of,
    in_net_namespace_of,
    last_step,
    leftovers,
    plain_ddp,
    run_cluster,
)
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


async def test_a_node_that_dies_loses_its_pod_to_a_spare_at_once(tmp_path: Path) -> None:
    command = plain_ddp(tmp_path / "ckpt", 300)
    killed: list[int] = []

    async def power_off(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / "d-1.log"
        await async_wait_until(lambda: last_step(pod_log, 1) >= 20, 120, "training on node-1")
        for pid in in_net_namespace_of(holder_of(log_dir, "node-1")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

    # a join timeout longer than the test: the pod must move because the node is down
    flags = ["--nodes", "2", "--spare-nodes", "1", "--job", "d", "--join-timeout-s", "600"]
    run = await run_cluster(tmp_path, flags, command, during=power_off, timeout_s=400)
    assert len(killed) >= 3, killed  # the holder, the agent, the training at least
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert run.pods["d-1"]["node"] == "spare-0", status
    placed = [(e["pod"], e["node"]) for e in run.events() if e["type"] == "PodRestarted"]
    # never on the dead node again (d-0 may be restarted on its own node: under load its
    # checks without d-1 can fail, a container restart, not counted)
    assert [node for pod, node in placed if pod == "d-1"] == ["spare-0"], placed
    assert "did not come back" not in (run.log_dir / "faults.jsonl").read_text()
    assert "node node-1 is down" in run.output, run.output
    assert [e["node"] for e in status["error_nodes"]] == ["node-1"], status
    assert [e["node"] for e in run.events() if e["type"] == "NodeDown"] == ["node-1"]
    assert "error nodes: node-1" in run.output, run.output
    assert leftovers(run.log_dir) == []
