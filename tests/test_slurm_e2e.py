"""End to end against real Slurm daemons (Debian's slurmctld/slurmd/munge) in a private network
namespace: ``aegis slurm submit`` -> sbatch -> coordinator -> srun steps of ``aegis agent``."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aegis.core.rendezvous import TORCH_PORT
from aegis.spawn.ports import free_port
from tests.agent_waits import processes_with
from tests.jsonl import json_lines
from tests.slurm_fixture import ADDRESSES, BRIDGE_ADDR, NODES, SlurmCluster, why_unavailable
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_REASON = why_unavailable()
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

TASK = Path(__file__).parent / "bin" / "slurm_task.py"
NVML = Path(__file__).parent / "bin" / "nvml"  # a stand-in for the NVIDIA library
FAILING_GPU = Path(__file__).parent / "data" / "nvml_v100_retired_pending.json"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
    except AssertionError:
        logs = slurm.logs()
        slurm.stop()
        raise AssertionError(f"the Slurm cluster did not come up:\n{logs}") from None
    yield slurm
    slurm.stop()


@pytest.fixture
def slurm(cluster: SlurmCluster, tmp_path: Path) -> Iterator[SlurmCluster]:
    """The module's cluster, every node back to idle afterwards (a test may drain one), and
    no process of the test's job left (coordinator, srun, agents, training all name tmp_path)."""
    yield cluster
    wait_until(lambda: not processes_with(str(tmp_path)), 30, "every process of the job gone")
    for node in NODES:
        cluster.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
    wait_until(lambda: _idle(cluster), 30, "every node idle again")


def _idle(cluster: SlurmCluster) -> bool:
    return all(cluster.node_state(node)[0] == "idle" for node in NODES)


def _submit(
    slurm: SlurmCluster,
    state: Path,
    *args: str,
    relative: bool = False,
    env: dict[str, str] | None = None,
) -> str:
    """``aegis slurm submit``; ``relative``: as a user in the task's directory types it
    (``python slurm_task.py``: every step must work there); ``env``: more of the submitter's
    environment (sbatch and every srun step pass it on)."""
    out = state.parent / f"{state.name}-out"
    out.mkdir()
    task = TASK.name if relative else str(TASK)
    argv = [sys.executable, "-m", "aegis", "slurm", "submit", "--job", state.name,
            "--state-dir", str(state), "--max-retry", "2", "--nodes", "2", "--spare-nodes", "1",
            *args, "--", sys.executable, task, str(out)]  # fmt: skip
    for task_flag in ("--crash-once", "--wait", "--meet"):
        if task_flag in argv:
            argv.remove(task_flag)
            argv.append(task_flag)
    result = slurm.run(argv, cwd=TASK.parent if relative else None, env=env)
    job_id = result.stdout.split("submitted job ")[1].split()[0]
    return job_id


def _finished(slurm: SlurmCluster, state: Path, job_id: str) -> dict[str, Any]:
    status_file = state / "status.json"

    def done() -> bool:
        queue = slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout
        return not queue.strip()

    try:
        wait_until(done, 120, f"slurm job {job_id} to finish")
    except AssertionError:
        raise AssertionError(_diagnostics(slurm, state)) from None
    assert status_file.exists(), _diagnostics(slurm, state)
    record: dict[str, Any] = json.loads(status_file.read_text())
    return record


def _diagnostics(slurm: SlurmCluster, state: Path) -> str:
    parts = [slurm.logs()]
    for path in sorted(state.rglob("*")):
        if path.is_file() and path.suffix in (".out", ".log", ".jsonl"):
            parts.append(f"--- {path}\n{path.read_text(errors='replace')[-3000:]}")
    return "\n".join(parts)


def _nodes(record: dict[str, Any]) -> dict[str, str]:
    return {pod: info["node"] for pod, info in record["status"]["pod_infos"].items()}


def test_slurm_job_runs_under_aegis_and_a_crash_is_recovered_in_place(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Submitted through sbatch from the script's directory (a relative ``slurm_task.py``),
    the job runs under Aegis (one srun step per pod, inside the allocation) and rank 0's crash
    costs one in-place restart on the same nodes."""
    state = tmp_path / "crash"
    job_id = _submit(slurm, state, "--crash-once", relative=True)
    record = _finished(slurm, state, job_id)
    assert record["status"]["phase"] == "Succeed", _diagnostics(slurm, state)
    assert record["status"]["recover_count"] == 1
    assert _nodes(record) == {"crash-0": "n1", "crash-1": "n2"}  # in place: no node moved
    assert record["status"]["error_nodes"] == []
    runs = (tmp_path / "crash-out" / "rank-0.jsonl").read_text().splitlines()
    assert len(runs) == 2  # the crashed run and the restarted one
    rank1 = json.loads((tmp_path / "crash-out" / "rank-1.jsonl").read_text().splitlines()[0])
    assert rank1["WORLD_SIZE"] == "2" and rank1["AEGIS_NODE"] == "n2"
    assert rank1["HOSTNAME"] == "n2"  # the step ran on n2's own host
    assert rank1["SLURM_JOB_ID"] == job_id  # the worker ran in a step of the allocation
    assert _idle(slurm)


def test_slurm_node_is_drained_when_its_gpu_check_fails(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    state = tmp_path / "gpu"
    job_id = _submit(slurm, state, "--inject-fault", "n2:gpu", "--crash-once")
    record = _finished(slurm, state, job_id)
    assert record["status"]["phase"] == "Succeed", _diagnostics(slurm, state)
    assert [e["node"] for e in record["status"]["error_nodes"]] == ["n2"]
    assert _nodes(record) == {"gpu-0": "n1", "gpu-1": "n3"}  # moved to the spare
    state_n2, reason = slurm.node_state("n2")
    assert state_n2 in ("drained", "draining")
    assert reason.startswith("aegis: ")
    assert "gpu" in reason
    listing = slurm.run(["sinfo", "-R", "-h", "-o", "%N|%E"]).stdout
    assert any(line.startswith("n2|aegis: ") for line in listing.splitlines()), listing


def test_slurm_node_whose_gpu_shows_warning_signs_is_drained_before_it_fails(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """``aegis slurm submit --health-s 1`` reaches every agent's srun step: while the job runs,
    n2's GPUs start to show warning signs (``tests/bin/nvml`` answers NVML's calls from a
    recording, per hostname), n2's agent says so, the master drains n2 in Slurm and its pod
    moves to the spare n3, with no fault counted. Before, the agents' ``--health-s`` was not
    passed and they looked every 30 s whatever was asked."""
    gpus = tmp_path / "gpus"  # <host>.json: that host's GPUs (none: healthy A100s)
    gpus.mkdir()
    state, out = tmp_path / "health", tmp_path / "health-out"
    env = {"PYTHONPATH": str(NVML), "AEGIS_TEST_NVML": str(gpus)}
    job_id = _submit(slurm, state, "--health-s", "1", "--wait", env=env)
    try:
        wait_until(lambda: _lines(out / "rank-1.jsonl") == 1, 120, "both ranks running")
        steps = [p.info["cmdline"] for p in processes_with(str(state))
                 if "--pod" in p.info["cmdline"]]  # fmt: skip
        looks = {cmd[cmd.index("--pod") + 1]: cmd[cmd.index("--health-s") + 1] for cmd in steps}
        assert looks == {"health-0": "1.0", "health-1": "1.0"}, steps  # each srun step's agent
        shutil.copy(FAILING_GPU, gpus / "n2.tmp")
        (gpus / "n2.tmp").rename(gpus / "n2.json")  # (never read half written)
        wait_until(lambda: _lines(out / "rank-1.jsonl") == 2, 120, "rank 1 started elsewhere")
    finally:
        (out / "go").touch()  # (the job ends, whatever failed: nothing left running)
    record = _finished(slurm, state, job_id)
    status = record["status"]
    assert (status["phase"], status["recover_count"]) == ("Succeed", 0), _diagnostics(slurm, state)
    assert _nodes(record) == {"health-0": "n1", "health-1": "n3"}
    assert [e["node"] for e in status["error_nodes"]] == ["n2"]
    assert json.loads((out / "rank-1.jsonl").read_text().splitlines()[-1])["HOSTNAME"] == "n3"
    state_n2, reason = slurm.node_state("n2")
    assert state_n2 in ("drained", "draining")
    assert reason.startswith("aegis: GPU health of n2 (health-1)"), reason


def test_slurm_requeued_job_resumes_with_what_is_left_of_its_budget(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """The allocation is lost (``scontrol requeue``) after one counted fault: Slurm restarts
    the batch script, the coordinator reads the store and runs the rest with budget 2 - 1."""
    state, out = tmp_path / "req", tmp_path / "req-out"
    job_id = _submit(slurm, state, "--crash-once", "--wait")
    try:
        wait_until(lambda: _lines(out / "rank-0.jsonl") == 2, 90, "the in-place restart")
    except AssertionError:
        raise AssertionError(_diagnostics(slurm, state)) from None
    slurm.run(["scontrol", "requeue", job_id])
    # Slurm holds a requeued batch job back (BeginTime) for a while; let it start now, once
    # its nodes have let the killed instance go and the clock is in a later second: slurmd
    # refuses a launch whose credential is no newer, to the second, than the kill it revoked
    # ("Killing non-startable batch JobId=3: Job credential revoked", seen in CI at load).
    wait_until(lambda: _job_state(slurm, job_id) == "PENDING", 60, "the job requeued")
    wait_until(lambda: all(slurm.node_state(n)[0] == "idle" for n in ("n1", "n2")), 60,
               "the killed instance gone from its nodes")  # fmt: skip
    released = int(time.time())
    wait_until(lambda: int(time.time()) > released, 5, "a later second")
    slurm.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])
    try:
        wait_until(lambda: _lines(out / "rank-0.jsonl") == 3, 120, "the requeued attempt's run")
    except AssertionError:
        raise AssertionError(_diagnostics(slurm, state)) from None
    (out / "go").write_text("1")
    record = _finished(slurm, state, job_id)
    assert record["spec"]["job"] == "req-r1", _diagnostics(slurm, state)
    assert record["spec"]["max_retry"] == 1  # 2 - the fault counted before the requeue
    assert record["status"]["phase"] == "Succeed"
    assert (state / "attempt-0" / "events.jsonl").exists()


def test_slurm_pod_moves_to_a_newly_requested_node_when_the_allocation_has_no_spare(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Two nodes, no spare: the gpu fault on n2 makes the coordinator ask Slurm for one more
    node (a one-node job holding it); the pod's new step runs there, and the holder job is
    gone when the job is."""
    state = tmp_path / "grow"
    job_id = _submit(slurm, state, "--spare-nodes", "0", "--inject-fault", "n2:gpu",
                     "--crash-once")  # fmt: skip
    record = _finished(slurm, state, job_id)
    assert record["status"]["phase"] == "Succeed", _diagnostics(slurm, state)
    assert _nodes(record) == {"grow-0": "n1", "grow-1": "n3"}
    assert [e["node"] for e in record["status"]["error_nodes"]] == ["n2"]
    holders = list((state / "attempt-0").glob("requested-node-*.out"))
    assert len(holders) == 1, _diagnostics(slurm, state)
    holder = holders[0].stem.rsplit("-", 1)[1]
    assert holder != job_id and not _job_state(slurm, holder)  # cancelled with the job
    rank1 = json.loads((tmp_path / "grow-out" / "rank-1.jsonl").read_text().splitlines()[-1])
    assert rank1["AEGIS_NODE"] == "n3" and rank1["SLURM_JOB_ID"] == holder


def test_slurm_rank0s_node_fails_and_the_rendezvous_follows_pod_0_to_its_new_host(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """Every slurmd on a host of its own: a gpu fault on n1, the node of rank 0 (and of the
    batch step), moves pod 0 to the spare n3; every rank is then told to meet on n3, and does
    (rank 0 listens on the address it was handed, rank 1 connects there from n2)."""
    state, out = tmp_path / "move", tmp_path / "move-out"
    job_id = _submit(slurm, state, "--inject-fault", "n1:gpu", "--crash-once", "--meet")
    record = _finished(slurm, state, job_id)
    status = record["status"]
    assert status["phase"] == "Succeed", _diagnostics(slurm, state)
    assert [e["node"] for e in status["error_nodes"]] == ["n1"]
    assert _nodes(record) == {"move-0": "n3", "move-1": "n2"}  # pod 0 moved, pod 1 stayed
    assert slurm.node_state("n1")[0] in ("drained", "draining")
    for pod, info in status["pod_infos"].items():  # a pod's address is its node's
        assert info["pod_ip"] == ADDRESSES[info["node"]], (pod, info)
    runs = {rank: json_lines(out / f"rank-{rank}.jsonl") for rank in (0, 1)}
    for run in (*runs[0], *runs[1]):
        assert run["HOSTNAME"] == run["AEGIS_NODE"], run  # each step on its node's own host
        _assert_own_shm(run)
    rank0, rank1 = runs[0][-1], runs[1][-1]  # the runs after the move
    assert (rank0["HOSTNAME"], rank1["HOSTNAME"]) == ("n3", "n2")
    assert rank0["MASTER_ADDR"] == rank1["MASTER_ADDR"] == ADDRESSES["n3"]  # rank 0's node
    assert rank0["MASTER_PORT"] == rank1["MASTER_PORT"]
    assert rank1["MET"] == "n3"  # and rank 1 reached rank 0 there, across hosts
    assert runs[0][0]["MASTER_ADDR"] == ADDRESSES["n1"]  # before the move: rank 0's old node
    for run in (*runs[0], *runs[1]):
        assert run["MASTER_ADDR"] == ADDRESSES[_rank0_node(runs[0], run)], run


def _rank0_node(rank0_runs: list[dict[str, Any]], run: dict[str, Any]) -> str:
    """Where rank 0 ran in ``run``'s round (every round has a port of its own)."""
    nodes = {r["MASTER_PORT"]: r["AEGIS_NODE"] for r in rank0_runs}
    assert run["MASTER_PORT"] in nodes, (run, rank0_runs)
    return str(nodes[run["MASTER_PORT"]])


def _assert_own_shm(run: dict[str, Any]) -> None:
    """The run saw in /dev/shm only what runs on its own host left there (``slurm_task.py``
    names a file ``slurm_task-<dir>-<rank>-<host>-<pid>``)."""
    hosts = {name.rsplit("-", 2)[1] for name in run["SHM"]}
    assert hosts == {run["HOSTNAME"]}, run


# A NATS server with auth on the given address, its keys saved for the master and the
# coordinator, until SIGTERM.
_NATS = """
import signal, sys
from pathlib import Path
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_server import EmbeddedNats
authority = Authority()
authority.save(Path(sys.argv[1]))
server = EmbeddedNats(authority, host=sys.argv[3])
server.start()
Path(sys.argv[2] + ".tmp").write_text(server.url)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # (after the server started)
Path(sys.argv[2] + ".tmp").rename(sys.argv[2])
signal.sigwait({signal.SIGTERM})  # the mask above: without it, SIGTERM killed this at once
server.stop()
"""


def test_slurm_job_runs_on_an_existing_master_that_drains_the_bad_node(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """``aegis slurm submit --master``: no master and no NATS server in the batch step; the
    running ``aegis master`` (on the bridge, where every node reaches it) leads the job, its
    requests (move the pod, drain the node) reach the allocation over NATS, and the job's end
    is read from its store."""
    auth, url_file, grpc = tmp_path / "auth.json", tmp_path / "nats.url", free_port()
    nats = [sys.executable, "-c", _NATS, str(auth), str(url_file), BRIDGE_ADDR]
    started = [slurm.spawn(nats, "nats.out")]
    try:
        wait_until(url_file.exists, 30, "the NATS server")
        url = url_file.read_text()
        started.append(slurm.spawn(
            [sys.executable, "-m", "aegis", "master", "--nats", url, "--auth-file", str(auth),
             "--grpc-host", BRIDGE_ADDR, "--grpc-port", str(grpc), "--replica-id", "m0",
             "--rendezvous-port-base", str(TORCH_PORT), "--log-dir", str(tmp_path / "m")],
            "master.out",
        ))  # fmt: skip
        state = tmp_path / "ext"
        job_id = _submit(slurm, state, "--master", f"{BRIDGE_ADDR}:{grpc}", "--nats", url,
                         "--auth-file", str(auth), "--inject-fault", "n2:gpu",
                         "--crash-once")  # fmt: skip
        record = _finished(slurm, state, job_id)
        assert record["status"]["phase"] == "Succeed", _diagnostics(slurm, state)
        assert [e["node"] for e in record["status"]["error_nodes"]] == ["n2"]
        assert _nodes(record) == {"ext-0": "n1", "ext-1": "n3"}
        assert slurm.node_state("n2")[0] in ("drained", "draining")
        assert not (state / "nats").exists()  # the batch step started no NATS server
        faults = (tmp_path / "m" / "faults.jsonl").read_text()  # the master led it
        assert '"job":"ext"' in faults.replace(" ", ""), faults
    finally:
        for proc in started:
            proc.terminate()
        codes = [proc.wait(timeout=30) for proc in started]
    assert codes[0] == 0, "the NATS server's script did not stop its server"


def _job_state(slurm: SlurmCluster, job_id: str) -> str:
    return slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0
