"""A standalone ``aegis master`` process seen from outside: ``aegis status JOB --nats URL`` reads
the job's record from the master's JetStream KV store, and ``--metrics-port`` serves /metrics
over HTTP. One real job (nats-server with operator auth, a real ``aegis master`` process, real
agents, a 3-rank gloo job): rank 0 crashes, node-1's gpu check fails, the pod on node-1 moves to
the spare, the job succeeds. The shared run is made once for the module."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aegis.adapters import lifecycle
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.platforms.local_run import RunSettings
from aegis.platforms.replicated_run import ReplicatedRun
from aegis.spawn.ports import free_port
from tests.scrape import parse, scrape, value
from tests.waits import async_wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"
AEGIS = [sys.executable, "-m", "aegis.cli.main"]
USER_LINE = "max restarts 2, restarted 1 times; hardware problems rescheduled 1 times"
FAMILIES = {
    "aegis_jobs_created", "aegis_jobs_succeeded", "aegis_jobs_failed", "aegis_recoveries",
    "aegis_faults", "aegis_fault_detection_latency_seconds", "aegis_recovery_duration_seconds",
    "aegis_check_duration_seconds", "aegis_round_duration_seconds", "aegis_check_failures",
    "aegis_pods", "aegis_jobs",
}  # fmt: skip


class MeteredRun(ReplicatedRun):
    """``aegis run --masters 1`` whose master is started with ``--metrics-port``."""

    metrics_port = 0

    def _spawn_master(self, index: int, port: int, auth_file: Path) -> subprocess.Popen[bytes]:
        url = getattr(self, "nats_url", "") or self.server.url
        argv = [*AEGIS, "master", "--nats", url, "--auth-file", str(auth_file),
                "--grpc-port", str(port), "--replica-id", f"master-{index}",
                "--lease-s", str(self.lease_s),
                "--heartbeat-timeout-s", str(self.settings.heartbeat_timeout_s),
                "--log-dir", str(self.log_dir),
                "--metrics-port", str(self.metrics_port)]  # fmt: skip
        with (self.log_dir / f"master-{index}.log").open("ab") as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env=lifecycle.child_env(self.master_env))  # fmt: skip


@dataclass
class Seen:
    """What the tests look at, gathered while the master ran."""

    nats_url: str = ""
    auth_file: Path = Path()
    before: str = ""  # /metrics once the job runs, before any fault
    after: str = ""  # /metrics once the job has ended (the master still up)
    running: list[subprocess.CompletedProcess[str]] = field(default_factory=list)
    final: subprocess.CompletedProcess[str] | None = None
    final_json: subprocess.CompletedProcess[str] | None = None
    missing: subprocess.CompletedProcess[str] | None = None
    wrong_auth: subprocess.CompletedProcess[str] | None = None
    phase: Phase | None = None
    log_dir: Path = Path()  # the master's --log-dir


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AEGIS, "status", *args], capture_output=True, text=True, timeout=60,
                          check=False, env=lifecycle.child_env(None))  # fmt: skip


async def _reached(run: ReplicatedRun, done: Any) -> bool:
    return bool(done(await run.status()))


async def _scenario(tmp: Path, seen: Seen) -> None:
    command = (sys.executable, str(TRAIN), "--steps", "40", "--ckpt-every", "2",
               "--ckpt-dir", str(tmp / "ckpt"), "--step-time-s", "0.05",
               "--exit-at-step", "6", "--exit-rank", "0")  # fmt: skip
    settings = RunSettings(command=command, nodes=3, spare_nodes=1, max_retry=2, job="obsm",
                           heartbeat_timeout_s=5.0, grace_s=2.0, log_dir=tmp,
                           inject={"node-1": frozenset({"gpu"})})  # fmt: skip
    run = MeteredRun(settings, 1, tmp)
    run.metrics_port = free_port()
    await run.start()
    try:
        seen.nats_url, seen.auth_file = run.server.url, tmp / ".auth.json"
        seen.log_dir = tmp
        store = ("--nats", seen.nats_url, "--auth-file", str(seen.auth_file))
        await async_wait_until(
            lambda: _reached(run, lambda s: s.phase is Phase.RUN_COMMAND), 120, "RUN_COMMAND"
        )
        seen.before = await asyncio.to_thread(scrape, run.metrics_port)
        seen.running.append(await asyncio.to_thread(status, "obsm", *store))
        await async_wait_until(
            lambda: _reached(run, lambda s: s.phase in TERMINAL_PHASES), 180, "the job to end"
        )
        seen.phase = (await run.status()).phase
        seen.after = await asyncio.to_thread(scrape, run.metrics_port)
        seen.final = await asyncio.to_thread(status, "obsm", *store)
        seen.final_json = await asyncio.to_thread(status, "obsm", *store, "--json")
        seen.missing = await asyncio.to_thread(status, "nosuchjob", *store)
        seen.wrong_auth = await asyncio.to_thread(status, "obsm", "--nats", seen.nats_url,
                                                  "--timeout-s", "20")  # fmt: skip
        assert all(proc.poll() is None for proc in run.masters), "the master must still run"
    finally:
        await run.finish()


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    out = Seen()
    asyncio.run(_scenario(tmp_path_factory.mktemp("master"), out))
    yield out


def test_master_job_succeeds_after_a_crash_and_a_gpu_fault(seen: Seen) -> None:
    assert seen.phase is Phase.SUCCEED


def test_the_standalone_master_writes_the_fault_log_in_its_log_dir(seen: Seen) -> None:
    lines = [json.loads(line) for line in (seen.log_dir / "faults.jsonl").open()]
    assert lines and {line["job"] for line in lines} == {"obsm"}
    assert {line["kind"] for line in lines} == {"phase_start", "phase_end", "report", "decision"}
    reports = [(line["pod"], line["message"]) for line in lines if line["kind"] == "report"]
    # (on a loaded machine allreduce_perf may add its own verdict after the gpu one)
    assert any(
        pod == "obsm-1" and text.startswith("checks failed: gpu: injected fault")
        for pod, text in reports
    ), reports
    moved = [line for line in lines if line["message"].startswith("evict (level 3)")]
    assert [(line["pod"], line["node"]) for line in moved] == [("obsm-1", "node-1")]


def test_status_from_the_store_prints_the_user_line_when_the_master_runs(seen: Seen) -> None:
    assert seen.final is not None and seen.final.returncode == 0, seen.final
    lines = seen.final.stdout.splitlines()
    assert lines[0] == "job obsm: Succeed"
    assert lines[1] == USER_LINE
    assert lines[2] == "error nodes: node-1"
    table = "\n".join(lines)
    for pod, node in (("obsm-0", "node-0"), ("obsm-1", "spare-0"), ("obsm-2", "node-2")):
        assert any(pod in line and node in line for line in lines), table
    assert lines[-1] == f"store: {seen.nats_url}"


def test_status_from_the_store_reads_a_job_while_it_runs(seen: Seen) -> None:
    (running,) = seen.running
    assert running.returncode == 0, running
    first, line = running.stdout.splitlines()[:2]
    assert first.startswith("job obsm: ")
    assert line.startswith("max restarts 2, restarted ")


def test_status_json_from_the_store_has_the_counts_and_the_pods(seen: Seen) -> None:
    assert seen.final_json is not None and seen.final_json.returncode == 0
    doc = json.loads(seen.final_json.stdout)
    assert doc["user_line"] == USER_LINE
    assert (doc["phase"], doc["max_restarts"], doc["restarted"]) == ("Succeed", 2, 1)
    assert doc["hardware_rescheduled"] == 1
    assert doc["error_nodes"] == ["node-1"]
    assert [p["pod"] for p in doc["pods"]] == ["obsm-0", "obsm-1", "obsm-2"]
    assert doc["status"]["recover_count"] == 1


def test_status_says_so_in_one_line_when_the_job_is_not_in_the_store(seen: Seen) -> None:
    assert seen.missing is not None
    assert seen.missing.returncode == 1
    assert seen.missing.stdout == ""
    assert seen.missing.stderr.splitlines() == [
        f"aegis: error: no job 'nosuchjob' in the store at {seen.nats_url} (namespace default)"
    ]


def test_status_fails_in_one_line_when_the_server_refuses_the_connection(seen: Seen) -> None:
    # The server runs in operator mode: without the master's keys it refuses the client; the
    # line says what to give (it said only "Authorization Violation" before).
    assert seen.wrong_auth is not None
    assert seen.wrong_auth.returncode == 1
    assert seen.wrong_auth.stderr.splitlines() == [
        f"aegis: error: cannot read the store at {seen.nats_url}: Authorization Violation "
        "(the server wants credentials: give --auth-file)"
    ]


def test_master_metrics_port_serves_every_family_over_http(seen: Seen) -> None:
    families = {f.name for f in text_string_to_metric_families(seen.after)}
    assert families >= FAMILIES, FAMILIES - families


def test_master_metrics_change_with_the_job(seen: Seen) -> None:
    before, after = parse(seen.before), parse(seen.after)
    assert value(before, "aegis_jobs_created_total", worker_num="3") == 1
    assert value(before, "aegis_jobs_succeeded_total") == 0
    assert value(before, "aegis_recoveries_total", level="node_replaced") == 0
    assert value(after, "aegis_jobs_created_total", worker_num="3") == 1
    assert value(after, "aegis_jobs_succeeded_total", worker_num="3") == 1
    assert value(after, "aegis_jobs_failed_total") == 0
    assert value(after, "aegis_recoveries_total", level="node_replaced") == 1
    assert value(after, "aegis_check_failures_total", check="gpu", round="troubleshoot") == 1
    assert value(after, "aegis_round_duration_seconds_count", round="bootcheck") == 1
