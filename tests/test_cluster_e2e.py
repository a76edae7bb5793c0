"""End to end on the emulated cluster (``aegis run --isolate-nodes``): every node its own
network, ``/dev/shm`` and hostname, so the multi-host bugs a shared host hides show here.

Each test asserts that the pods had distinct addresses (their ``pod_ip`` in the status file),
that every round met where rank 0's pod was then, and that no rank saw another node's shared
memory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from aegis.spawn.ports import free_port
from tests.cluster import (
    AEGIS,
    TRAIN,
    address_of,
    assert_each_node_kept_to_itself,
    ctl,
    leftovers,
    master_pid,
    probe,
    require_namespaces,
    run_cluster,
)
from tests.scrape import scrape
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _ips(run_pods: dict[str, dict[str, object]]) -> list[object]:
    return [info["pod_ip"] for _, info in sorted(run_pods.items())]


async def test_a_crash_is_recovered_in_place_with_every_node_on_its_own_host(
    tmp_path: Path,
) -> None:
    command = probe(tmp_path / "out", str(tmp_path / "logs" / "checkpoints"), "--fail-rank", "1",
                    "--fail-at-step", "7")  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "3", "--spare-nodes", "1", "--job", "c"], command)
    assert run.rc == 0, run.output
    assert run.status["status"]["phase"] == "Succeed"
    assert [p["retries"] for _, p in sorted(run.pods.items())] == [1, 1, 1]
    assert _ips(run.pods) == [address_of(0), address_of(1), address_of(2)]
    for rank in range(3):
        first, second = run.records(rank)
        assert first["hostname"] == f"node-{rank}" and first["address"] == address_of(rank)
        # every round meets on rank 0's node
        assert first["master"].startswith(f"{address_of(0)}:"), first
        assert second["master"].startswith(f"{address_of(0)}:"), second
        assert first["master"] != second["master"]  # a fresh port for the new round
        # in place: restored from the node's own shared memory, no disk read
        assert second["incarnation"] == 1 and second["resumed_from"] >= 2, second
        assert second["opened"] == [], second
    assert_each_node_kept_to_itself(run, 3)
    assert leftovers(run.log_dir) == []


async def test_a_gpu_fault_on_rank_0s_node_moves_the_rendezvous_to_the_spare(
    tmp_path: Path,
) -> None:
    """Rank 0 exits with no traceback, the checks find node-0's GPU broken: its pod moves to
    spare-0, every rank meets there next, and rank 0 resumes from the durable checkpoint (the
    spare's shared memory is empty) while the others resume from their own. No agent imported
    torch for its bootcheck or its check round: their runtime checks ran in a child."""
    command = probe(tmp_path / "out", str(tmp_path / "logs" / "checkpoints"), "--fail-rank", "0",
                    "--fail-at-step", "7", "--fail-how", "exit")  # fmt: skip
    run = await run_cluster(
        tmp_path,
        ["--nodes", "3", "--spare-nodes", "1", "--job", "g", "--inject-fault", "node-0:gpu",
         "--max-retry", "2"],
        command,
    )  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert [e["node"] for e in status["error_nodes"]] == ["node-0"]
    assert run.pods["g-0"]["node"] == "spare-0"
    assert _ips(run.pods) == [address_of(3), address_of(1), address_of(2)]
    moved = run.records(0)[-1]
    assert (moved["hostname"], moved["address"]) == ("spare-0", address_of(3))
    assert moved["opened"] != [], moved  # from disk: a fresh node's memory holds nothing
    resumed = {run.records(r)[-1]["resumed_from"] for r in range(3)}
    assert len(resumed) == 1 and resumed != {0}, resumed
    for rank in range(3):
        last = run.records(rank)[-1]
        assert last["master"].startswith(f"{address_of(3)}:"), last  # rank 0's new node
        if rank:
            assert last["opened"] == [], last  # their own node's memory
    for rank in range(3):
        assert all(r["agent_torch"] == [] for r in run.records(rank)), run.records(rank)
    runtime = [(e["phase"], r) for e in run.events() if e.get("type") == "Finish"
               for r in e["data"].get("response", {}).get("results", [])
               if r["check_type"] == "runtime"]  # fmt: skip
    assert {phase for phase, _ in runtime} == {"BootChecking", "Troubleshooting"}, runtime
    assert all(r["passed"] and "torch=2.13" in r["result"] for _, r in runtime), runtime
    faults = [json.loads(line) for line in (run.log_dir / "faults.jsonl").open()]
    on_node_0 = [f for f in faults if f["node"] == "node-0"]
    assert on_node_0 and {f["node_ip"] for f in on_node_0} == {address_of(0)}, faults
    assert_each_node_kept_to_itself(run, 3)
    assert leftovers(run.log_dir) == []


TORCHRUN_SCRIPT = """\
import os, socket, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = sys.argv[1]
restart = os.environ.get("AEGIS_RESTART_COUNT", "0")
host = socket.gethostname()
with open(os.path.join(out, f"r{rank}-i{restart}"), "w") as f:
    f.write(f"{host} {os.environ['HOSTNAME']} {os.environ['MASTER_ADDR']} {world}\\n")
    f.write("\\n".join(os.listdir("/dev/shm")))
value = torch.ones(1)
for step in range(20):
    dist.all_reduce(value)
    value /= value.item()
    if rank == 3 and step == 10 and restart == "0":
        raise RuntimeError("injected failure of rank 3")
    time.sleep(0.05)
dist.destroy_process_group()
"""


async def test_torchrun_with_two_workers_in_each_of_two_pods(tmp_path: Path) -> None:
    """A script that never imports aegis, under ``torchrun --nproc-per-node 2`` in each pod
    (torchrun reads the PET_* variables): 4 ranks on 2 hosts; one worker fails once, both
    pods restart in place, and every rank meets on rank 0's pod each time. The command names
    its script and output relatively, as typed in the working directory: every node works there
    (entering a node's mount namespace alone would put it at ``/``)."""
    script, out = tmp_path / "tr.py", tmp_path / "out"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "tr.py", "out"]  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "2", "--spare-nodes", "0", "--job", "t"], command,
                            cwd=tmp_path)  # fmt: skip
    assert run.rc == 0, run.output
    assert run.status["status"]["recover_count"] == 1
    assert _ips(run.pods) == [address_of(0), address_of(1)]
    for incarnation in (0, 1):
        for rank in range(4):
            first, *shm = (out / f"r{rank}-i{incarnation}").read_text().splitlines()
            host, named, master, world = first.split()
            node = f"node-{rank // 2}"  # its pod's host, by name and by $HOSTNAME
            assert (host, named, master, world) == (node, node, address_of(0), "4")
            other = f"-t-{1 - rank // 2}-"  # the other pod's shared memory is not visible
            assert shm and not [name for name in shm if other in name], shm
    assert leftovers(run.log_dir) == []


ORPHANING_SCRIPT = """\
import os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, out = dist.get_rank(), sys.argv[1]
restart = os.environ["AEGIS_RESTART_COUNT"]
earlier = []
if restart == "1":  # which worker of the first attempt still lives?
    for name in os.listdir(out):
        if name.startswith("pid-i0-"):
            pid = int(open(os.path.join(out, name)).read())
            try:
                os.kill(pid, 0)
                earlier.append(pid)
            except ProcessLookupError:
                pass
with open(os.path.join(out, f"pid-i{restart}-r{rank}"), "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(out, f"alive-i{restart}-r{rank}"), "w") as f:
    f.write(" ".join(map(str, earlier)))
value = torch.ones(1)
for step in range(20):
    if restart == "0" and step == 5 and rank >= 2:  # node-1: its torchrun dies (OOM-killed,
        if rank == 2:                               # say), its workers hang on, holding the
            os.kill(os.getppid(), signal.SIGKILL)   # GPU, in sessions of their own
        time.sleep(600)
    dist.all_reduce(value)
    value /= value.item()
    time.sleep(0.05)
dist.destroy_process_group()
"""


async def test_workers_orphaned_by_their_torchrun_are_stopped_before_the_restart(
    tmp_path: Path,
) -> None:
    """torchrun SIGKILLed on node-1 (a script that never imports aegis, two workers a pod): its
    workers, in sessions of their own, outlive it and are re-parented to the agent. The agent
    stops them before it reports the exit, so no worker of the first attempt lives while the
    second runs (it would hold the GPU's memory and the old round's sockets), nor after."""
    script, out = tmp_path / "orphans.py", tmp_path / "out"
    script.write_text(ORPHANING_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "orphans.py", "out"]  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "2", "--spare-nodes", "0", "--job", "o",
                                       "--grace-s", "3"], command, cwd=tmp_path)  # fmt: skip
    assert run.rc == 0, run.output
    assert run.status["status"]["recover_count"] == 1
    first = {int((out / f"pid-i0-r{rank}").read_text()) for rank in range(4)}
    for rank in range(4):  # the second attempt saw none of the first alive
        assert (out / f"alive-i1-r{rank}").read_text() == "", rank
    assert not [pid for pid in first if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    agent_log = (run.log_dir / "pods" / "o-1.log").read_text()
    assert "stopping 2 process(es) the command left behind outside its group" in agent_log
    assert leftovers(run.log_dir) == []


@pytest.mark.timing
async def test_a_drain_from_the_host_moves_the_pod_to_a_spare_with_nothing_counted(
    tmp_path: Path,
) -> None:
    """``aegis ctl drain`` runs on the host and reaches the master inside the run's namespace;
    the pod leaves at the next committed checkpoint, with a new address on the spare."""
    command = probe(tmp_path / "out", str(tmp_path / "logs" / "checkpoints"), "--steps", "400",
                    "--step-time-s", "0.05")  # fmt: skip
    drained: list[str] = []

    async def drain(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        out = tmp_path / "out"
        await async_wait_until((out / "rank-1.jsonl").exists, 120, "training to start on node-1")
        drained.append(await ctl("drain", "node-1", "--log-dir", str(log_dir)))

    run = await run_cluster(
        tmp_path, ["--nodes", "2", "--spare-nodes", "1", "--job", "d"], command, during=drain
    )
    assert drained and drained[0].startswith("0: "), drained
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["recover_count"] == 0 and status["error_nodes"] == []
    assert run.pods["d-1"]["node"] == "spare-0"
    assert _ips(run.pods) == [address_of(0), address_of(2)]
    moved = run.records(1)[-1]
    assert moved["hostname"] == "spare-0" and moved["opened"] != [], moved
    assert_each_node_kept_to_itself(run, 2)
    assert leftovers(run.log_dir) == []


@pytest.mark.timing
async def test_the_leader_killed_mid_training_the_standby_leads_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """``--masters 2`` inside the cluster: the masters listen on the bridge, the agents on their
    nodes reach whichever leads. The leader is SIGKILLed from the host once every rank trains;
    the standby leads the job, nothing is counted, training never restarts; meanwhile the
    masters' ``/metrics`` answer on the host's loopback (a forwarder into the namespace)."""
    port = free_port()
    command = probe(tmp_path / "out", str(tmp_path / "logs" / "checkpoints"), "--steps", "120",
                    "--step-time-s", "0.05")  # fmt: skip
    killed: list[str] = []
    scraped: list[str] = []

    async def kill_leader(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        out = tmp_path / "out"
        await async_wait_until(
            lambda: all((out / f"rank-{r}.jsonl").exists() for r in range(2)), 120, "training"
        )
        leader = next(
            i for i in range(2)
            if "leads job default.f" in (log_dir / f"master-{i}.log").read_text()
        )  # fmt: skip
        scraped.append(await asyncio.to_thread(scrape, port + leader))
        pid = master_pid(log_dir, leader)
        os.kill(pid, signal.SIGKILL)
        killed.append(f"master-{leader}")

    run = await run_cluster(
        tmp_path,
        ["--nodes", "2", "--spare-nodes", "0", "--job", "f", "--masters", "2",
         "--metrics-port", str(port)],
        command,
        during=kill_leader,
    )  # fmt: skip
    assert killed, run.output
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["recover_count"] == 0 and status["phase"] == "Succeed"
    assert _ips(run.pods) == [address_of(0), address_of(1)]
    assert [len(run.records(r)) for r in range(2)] == [1, 1]  # never restarted
    standby = 1 - int(killed[0].split("-")[1])
    assert "leads job default.f" in (run.log_dir / f"master-{standby}.log").read_text()
    assert "aegis_" in scraped[0]
    assert_each_node_kept_to_itself(run, 2)
    assert leftovers(run.log_dir) == []


@pytest.mark.timeout(420)
@pytest.mark.timing
async def test_a_node_that_turns_slow_is_evicted_to_a_spare_at_the_next_commit(
    tmp_path: Path,
) -> None:
    """node-1 turns slow (stopped from outside part of every period) at the first commit; the
    pace watch notices, allreduce_perf names node-1 across the bridge, the pod leaves at the
    next committed checkpoint for spare-0 and its new address; nothing is counted."""
    command = [sys.executable, str(TRAIN), "--steps", "900", "--ckpt-every", "300",
               "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    run = await run_cluster(
        tmp_path,
        ["--nodes", "3", "--spare-nodes", "1", "--job", "s", "--inject-fault", "node-1:slow",
         "--pace-window-s", "3", "--pace-drop", "0.5", "--heartbeat-timeout-s", "10",
         "--max-retry", "2"],
        command,
        timeout_s=400,
    )  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    # (the run's own lines say whether node-1 turned slow, and whether the pace watch saw it)
    assert [e["node"] for e in status["error_nodes"]] == ["node-1"], run.output
    assert status["recover_count"] == 0
    assert run.pods["s-1"]["node"] == "spare-0"
    assert _ips(run.pods) == [address_of(0), address_of(3), address_of(2)]
    assert leftovers(run.log_dir) == []


def test_without_root_the_emulated_cluster_is_refused_in_one_line(tmp_path: Path) -> None:
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    argv = [*nobody, *AEGIS, "run", "--isolate-nodes", "--", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result
    assert result.stderr.strip().splitlines() == [
        "aegis: error: --isolate-nodes needs root (network, mount and UTS namespaces)"
    ]


async def test_a_sigkilled_run_leaves_no_process_and_no_namespace_behind(tmp_path: Path) -> None:
    """``aegis run --isolate-nodes`` SIGKILLed on the host while it trains: the run inside its
    namespace, the node holders, NATS, the agents and the training processes all go (each dies
    with its parent), and with them the namespaces; nothing was made under /run/netns."""
    require_namespaces()
    before = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    out, log_dir = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    command = probe(out, str(log_dir / "checkpoints"), "--steps", "100000")
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "run", "--isolate-nodes", "--nodes", "2", "--view", "plain",
        "--log-dir", str(log_dir), "--", *command,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # NATS' directory: no clean-up can run
    )  # fmt: skip
    try:
        await async_wait_until(
            lambda: all((out / f"rank-{r}.jsonl").exists() for r in range(2)), 120, "training"
        )
        holders = [p for p in leftovers(log_dir) if "aegis-node node-" in p]
        assert holders, leftovers(log_dir)
    finally:
        proc.kill()
        await proc.wait()
    await async_wait_until(lambda: leftovers(log_dir) == [], 60, "every process of the run gone")
    after = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    assert after == before
