"""End to end: ``aegis run`` with a real nats-server, real agents and a real 3-rank gloo job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from aegis.agent import watchdog
from aegis.core.phases import Phase
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform, session_members
from aegis.tools import replay
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"


def _settings(tmp_path: Path, *extra: str, **overrides: object) -> local_run.RunSettings:
    command = (sys.executable, str(TRAIN), "--steps", "30", "--ckpt-every", "5",
               "--ckpt-dir", str(tmp_path / "ckpt"), *extra)  # fmt: skip
    base: dict[str, object] = {
        "command": command,
        "nodes": 3,
        "spare_nodes": 1,
        "max_retry": 2,
        "job": "e2e",
        "heartbeat_timeout_s": 10.0,  # a loaded machine starves an agent for seconds
        "grace_s": 3.0,
        "log_dir": tmp_path / "logs",
        "status_file": tmp_path / "status.json",
    }
    base.update(overrides)
    return local_run.RunSettings(**base)  # type: ignore[arg-type]


def _retries(result: local_run.RunResult) -> list[int]:
    return [info.retries for _, info in sorted(result.status.pod_infos.items())]


def _assert_nothing_left(result: local_run.RunResult) -> None:
    agents = {pid for pids in result.agent_pids_seen.values() for pid in pids}
    for pid in agents:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
        assert session_members(pid) == []
    # no agent's progress file in /dev/shm (a killed one's is removed by its replacement)
    owners = {name: watchdog.owner_of(name) for name in os.listdir("/dev/shm")}
    assert [n for n, owner in owners.items() if owner and owner[1] in agents] == []


def _assert_replays(result: local_run.RunResult) -> None:
    lines = (result.log_dir / "events.jsonl").read_text().splitlines()
    _, final = replay.final_status(lines)
    assert final == result.status


async def test_clean_run_succeeds_with_zero_retries(tmp_path: Path) -> None:
    result = await local_run.run_local(_settings(tmp_path))
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert _retries(result) == [0, 0, 0] and result.exit_code == 0
    status_file = (tmp_path / "status.json").read_text()
    assert '"phase": "Succeed"' in status_file
    _assert_nothing_left(result)


async def test_one_crash_restarts_every_rank_in_place_and_resumes(tmp_path: Path) -> None:
    result = await local_run.run_local(
        _settings(tmp_path, "--crash-at-step", "12", "--crash-rank", "1")
    )
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert _retries(result) == [1, 1, 1] and result.status.recover_count == 1
    # in place: each pod kept its one agent process
    assert all(len(pids) == 1 for pids in result.agent_pids_seen.values())
    log = (result.log_dir / "pods" / "e2e-0.log").read_text()
    # a software fault: restarted at once, from the step every pod had committed by then (the
    # crashed rank's save of step 10 may not have been reported yet)
    assert re.search(r"resumed from aegis checkpoint at step (5|10) \(incarnation 1\)", log), log
    # Reported as the interpreter began to exit (aegis.training's excepthook), once.
    events = [json.loads(line) for line in (result.log_dir / "events.jsonl").open()]
    assert not any(e.get("phase") == "Troubleshooting" for e in events)  # no checks run
    errors = [e for e in events if e.get("type") == "Error"]
    assert [(e["pod"], e["data"]["fault_class"]) for e in errors] == [("e2e-1", "python_traceback")]
    said = errors[0]["data"]["reason"]  # the traceback's own last line
    assert said.startswith("uncaught RuntimeError: injected crash of rank 1 at step "), said
    assert said.endswith(" (reported as the process exits)"), said
    _assert_replays(result)
    _assert_nothing_left(result)


async def test_always_crashing_rank_fails_after_max_retry_plus_one_faults(tmp_path: Path) -> None:
    result = await local_run.run_local(_settings(tmp_path, "--always-crash-rank", "2"))
    assert result.status.phase is Phase.FAILED and result.exit_code == 1
    assert result.status.recover_count == 3  # max_retry + 1
    assert max(_retries(result)) == 3 and result.status.should_quit
    _assert_replays(result)
    _assert_nothing_left(result)


async def test_injected_gpu_fault_moves_pod_to_spare_and_blacklists_node(tmp_path: Path) -> None:
    settings = _settings(
        tmp_path, "--exit-at-step", "8", "--exit-rank", "0",
        inject={"node-1": frozenset({"gpu"})},
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert [e.node for e in result.status.error_nodes] == ["node-1"]
    assert result.status.pod_infos["e2e-1"].node == "spare-0"  # type: ignore[index]
    placements = [node for pod, node in result.placements]
    assert placements.count("node-1") == 1  # never placed there again
    _assert_replays(result)
    _assert_nothing_left(result)


@pytest.mark.timing
async def test_killed_agent_is_detected_by_heartbeat_loss_and_replaced(tmp_path: Path) -> None:
    killed: list[int] = []
    killed_at: list[float] = []

    def kill_once_running(runner: JobRunner, platform: LocalPlatform) -> None:
        def on_event(r: JobRunner, event: object, actions: object) -> None:
            if r.status.phase is Phase.RUN_COMMAND and not killed:
                pid = platform.agent_pids()["e2e-2"]  # type: ignore[index]
                killed.append(pid)
                killed_at.append(time.time())
                os.kill(pid, signal.SIGKILL)

        runner.listeners.append(on_event)

    result = await local_run.run_local(
        _settings(tmp_path, "--step-time-s", "0.1"), observe=kill_once_running
    )
    assert killed, "the agent was never killed"
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert result.status.recover_count == 1 and _retries(result) == [1, 1, 1]
    events = (result.log_dir / "events.jsonl").read_text()
    assert events.count('"type":"HeartbeatLost"') == 1
    records = [json.loads(line) for line in events.splitlines()]
    lost = next(r for r in records if r.get("type") == "HeartbeatLost")
    # After the kill, and within the timeout (10 s) plus the watcher's poll and a loaded machine.
    assert lost["pod"] == "e2e-2" and 0.0 < lost["ts"] - killed_at[0] <= 10.0 + 3.0
    # Replaced: a new agent for e2e-2 came back (PodRestarted) and the job went on.
    assert any(r.get("type") == "PodRestarted" and r.get("pod") == "e2e-2" for r in records)
    assert len(result.agent_pids_seen["e2e-2"]) == 2
    wait_until(lambda: not session_members(killed[0]), what="killed pod's processes gone")
    _assert_nothing_left(result)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nodes", "0"], "'--nodes'"),
        (["--inject-fault", "node-1"], "expected NODE:CHECK"),
        (["--inject-fault", "node-1:nosuchcheck"], "got 'node-1:nosuchcheck'"),
        (["--view", "fancy"], "one of auto, live, plain"),
        (["--max-retry", "-1"], "'--max-retry'"),
        (["--masters", "3", "--metrics-port", "65534"], "master 2 would serve on 65536"),
        (["--pace-drop", "1.5"], "'--pace-drop'"),
        (["--pace-window-s", "-1"], "'--pace-window-s'"),
    ],
)
def test_aegis_run_refuses_a_bad_argument_with_one_line_and_exit_2(
    args: list[str], says: str
) -> None:
    argv = [sys.executable, "-m", "aegis.cli.main", "run", *args, "--", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aegis: error: ") and says in lines[0], lines
    assert result.stdout == ""


async def test_every_pod_gets_the_torchrun_and_kubeflow_environment(tmp_path: Path) -> None:
    """What a training script reads to join the group, as each pod's command sees it."""
    out = tmp_path / "env"
    out.mkdir()
    script = (
        "import json, os, sys\n"
        "path = os.path.join(sys.argv[1], os.environ['AEGIS_POD'] + '.json')\n"
        "open(path, 'w').write(json.dumps(dict(os.environ)))\n"
    )
    command = (sys.executable, "-c", script, str(out))
    result = await local_run.run_local(_settings(tmp_path, command=command, nodes=2))
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(seen) == ["e2e-0", "e2e-1"]
    ports = {env["MASTER_PORT"] for env in seen.values()}
    addrs = {env["MASTER_ADDR"] for env in seen.values()}
    assert len(ports) == 1 and next(iter(ports)).isdigit()  # one rendezvous for the job
    assert len(addrs) == 1
    for rank, pod in enumerate(("e2e-0", "e2e-1")):
        env = seen[pod]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert (env["PET_NNODES"], env["PET_NODE_RANK"]) == ("2", str(rank))
        assert (env["AEGIS_JOB"], env["AEGIS_POD"], env["AEGIS_NODE"]) == (
            "e2e",
            pod,
            f"node-{rank}",
        )
        assert env["AEGIS_RESTART_COUNT"] == "0"
    _assert_nothing_left(result)


@pytest.mark.timing
async def test_agents_fetch_new_credentials_when_theirs_expire_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """Credentials minted for 3 s: the server closes each agent's connection at expiry, the
    agent bootstraps again (SyncWorkerCreds) and reconnects; nothing is counted."""
    result = await local_run.run_local(
        _settings(tmp_path, "--step-time-s", "0.2", creds_ttl_s=3.0, nodes=2)
    )
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert result.status.recover_count == 0 and _retries(result) == [0, 0]
    for pod in ("e2e-0", "e2e-1"):
        log = (result.log_dir / "pods" / f"{pod}.log").read_text()
        assert "bootstrapping again" in log, pod
    _assert_nothing_left(result)


async def test_a_rank_killed_mid_training_resumes_from_shared_memory_without_a_disk_read(
    tmp_path: Path,
) -> None:
    """Under real agents, rank 1 dies at step 5; every rank is restarted in place and resumes
    from step 4 in its agent's shared memory: no file of the checkpoint directory is opened,
    though step 4 is committed there too."""
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    settings = local_run.RunSettings(
        command=(sys.executable, str(Path(__file__).parent / "bin" / "ckpt_resume.py"),
                 str(out), str(ckpt)),
        nodes=2, spare_nodes=0, max_retry=1, job="shm", grace_s=2.0, log_dir=tmp_path / "logs",
        ckpt_dir=ckpt,
    )  # fmt: skip
    result = await local_run.run_local(settings)
    assert result.status.phase is Phase.SUCCEED and result.status.recover_count == 1
    for rank in ("0", "1"):
        first, second = map(json.loads, (out / f"rank-{rank}.jsonl").read_text().splitlines())
        assert first["incarnation"] == 0 and first["resumed_from"] == 0
        assert second["incarnation"] == 1 and second["opened"] == [], second
        assert second["resumed_from"] >= 4 and second["found"] == second["resumed_from"]
    assert second["resumed_from"] == 4  # rank 1 died before its step 6
    assert any(p.name == "data.bin" for p in ckpt.rglob("*")), "nothing committed on disk"


@pytest.mark.parametrize(
    ("masters", "sig", "code"),
    [("1", signal.SIGINT, 130), ("1", signal.SIGTERM, 143), ("1", signal.SIGHUP, 129),
     ("2", signal.SIGINT, 130), ("2", signal.SIGTERM, 143)],
)  # fmt: skip
def test_aegis_run_stopped_by_a_signal_exits_128_plus_its_number(
    tmp_path: Path, masters: str, sig: signal.Signals, code: int
) -> None:
    """Ctrl-C, SIGTERM or SIGHUP (the terminal closed) while the job trains stops it and
    everything it started; the exit status says a signal ended it, as a shell's does, and the
    last line why. (It was 1, as if the job had failed, with one master; with replicas there was
    no last line, and SIGTERM once left a master running for good. SIGHUP killed the run at
    once, with no status file.)"""
    out = tmp_path / "out.log"
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--nodes", "2", "--spare-nodes", "0",
            "--masters", masters, "--view", "plain", "--log-dir", str(tmp_path / "logs"), "--",
            sys.executable, "-c", "import time; time.sleep(300)", str(tmp_path)]  # fmt: skip
    with out.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "phase RunCommand" in out.read_text(), 120.0, "the job to train")
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"Failed (aegis run got {sig.name})" in out.read_text().splitlines()[-1]

    def left() -> list[int]:
        sleeping = (p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"])
        # (the training's argv names tmp_path too: another run's sleep on the machine is not it)
        return [p.pid for p in sleeping if str(tmp_path) in " ".join(p.info["cmdline"])]

    wait_until(lambda: not left(), 30.0, "nothing of the run left")  # agents, zygotes, daemons
