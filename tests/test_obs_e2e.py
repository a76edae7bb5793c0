"""Observability end to end: real ``aegis run`` jobs (nats-server, agents, a gloo job), scraped
over HTTP, and the operator's commands on their log directories.

Two runs are shared by the tests of this module: a crash followed by an injected gpu fault (a
level 3 recovery), and a job whose ranks hang until the budget is spent.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from rich.console import Console

from aegis.cli import live_view, run_cmd, run_view
from aegis.core import events as ev
from aegis.core.phases import Phase
from aegis.master import metrics
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform
from tests.scrape import parse, scrape, value

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

ROOT = Path(__file__).parent.parent
TRAIN = ROOT / "examples" / "train_ddp.py"
HANG = Path(__file__).parent / "bin" / "hang.py"
DASHBOARD = ROOT / "deploy" / "grafana" / "aegis.json"
AEGIS = [sys.executable, "-m", "aegis.cli.main"]


@dataclass
class Run:
    result: local_run.RunResult
    port: int
    during: list[str] = field(default_factory=list)  # scrapes taken while the job ran
    after: str = ""
    plain: str = ""
    live: str = ""


def _run(settings: local_run.RunSettings) -> Run:
    hub = metrics.MasterMetrics()
    server = hub.serve(0)
    plain = io.StringIO()
    console = Console(record=True, file=io.StringIO(), force_terminal=True, width=140)
    live = live_view.LiveView(console, total_steps=12)
    observers = run_cmd.RunObservers(run_view.PlainView(plain), metrics_hub=hub)
    during: list[str] = []

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        observers.attach(runner, platform)
        live.attach(runner, platform)
        seen = [runner.status.phase]

        def scrape_on_recovery(r: JobRunner, event: ev.Event, actions: object) -> None:
            if r.status.phase is Phase.RUN_COMMAND and seen[-1] is not Phase.RUN_COMMAND:
                during.append(scrape(server.port))  # the job is running: real HTTP, now
            seen.append(r.status.phase)

        runner.listeners.append(scrape_on_recovery)

    try:
        result = asyncio.run(local_run.run_local(settings, observe=observe))
        after = scrape(server.port)
    finally:
        observers.close()
        live.stop()
        server.close()
    return Run(result, server.port, during, after, plain.getvalue(), console.export_text())


def _settings(tmp: Path, command: tuple[str, ...], **overrides: object) -> local_run.RunSettings:
    base: dict[str, object] = {
        "command": command, "nodes": 3, "spare_nodes": 1, "max_retry": 2, "job": "obs",
        "heartbeat_timeout_s": 5.0, "grace_s": 2.0, "log_dir": tmp / "logs",
    }  # fmt: skip
    base.update(overrides)
    return local_run.RunSettings(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("gpu")
    # an exit with no traceback: the master runs the checks (which find node-1's gpu)
    crash = ("--exit-at-step", "4", "--exit-rank", "0")
    command = (sys.executable, str(TRAIN), "--steps", "12", "--ckpt-every", "2",
               "--ckpt-dir", str(tmp / "ckpt"), *crash)  # fmt: skip
    yield _run(_settings(tmp, command, inject={"node-1": frozenset({"gpu"})}))


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("hang")
    command = (sys.executable, str(HANG), "progress")
    yield _run(_settings(tmp, command, nodes=2, max_retry=1, hang_timeout_s=1.0, job="stuck"))


def aegis(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AEGIS, *args], capture_output=True, text=True, timeout=60, check=False)


# -- metrics -----------------------------------------------------------------------------------


def _checks_in_event_log(log_dir: Path) -> dict[tuple[str, str], int]:
    """(check, round) -> reports, straight from the master's event log (the ground truth)."""
    counts: dict[tuple[str, str], int] = {}
    for line in (log_dir / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("data", {}).get("kind") != "checks":
            continue
        kind = metrics.ROUND_NAMES[Phase(record["phase"])]
        for result in record["data"]["response"]["results"]:
            key = (result["check_type"], kind)
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_metrics_count_recoveries_and_checks_when_crash_then_gpu_fault(gpu_run: Run) -> None:
    result = gpu_run.result
    assert result.status.phase is Phase.SUCCEED, result.log_dir
    assert gpu_run.during, "no scrape while the job ran"
    running = parse(gpu_run.during[-1])  # right after the recovery, training again
    assert value(running, "aegis_recoveries_total", level="node_replaced") == 1
    assert value(running, "aegis_recoveries_total", level="in_place") == 0
    assert value(running, "aegis_pods", inner_phase="RunCommand") == 3
    assert value(running, "aegis_jobs", phase="RunCommand") == 1
    assert value(running, "aegis_jobs_succeeded_total") == 0
    after = parse(gpu_run.after)
    assert value(after, "aegis_jobs_created_total", worker_num="3") == 1
    assert value(after, "aegis_jobs_succeeded_total", worker_num="3") == 1
    assert value(after, "aegis_jobs_failed_total") == 0
    assert value(after, "aegis_recoveries_total", level="node_replaced") == 1
    assert value(after, "aegis_recovery_duration_seconds_count", level="node_replaced") == 1
    assert value(after, "aegis_faults_total", detector="error", counted="true") == 1
    assert value(after, "aegis_fault_detection_latency_seconds_count", detector="error") == 1
    assert value(after, "aegis_check_failures_total", check="gpu", round="troubleshoot") == 1
    # two troubleshoot rounds (before and after the replacement) of three pods each
    assert (
        value(after, "aegis_check_duration_seconds_count", check="gpu", round="troubleshoot") == 6
    )
    assert value(after, "aegis_round_duration_seconds_count", round="troubleshoot") == 2
    assert value(after, "aegis_round_duration_seconds_count", round="bootcheck") == 1
    for (check, kind), count in _checks_in_event_log(result.log_dir).items():
        got = value(after, "aegis_check_duration_seconds_count", check=check, round=kind)
        assert got == count, (check, kind)
    assert value(after, "aegis_pods") == 0  # no running job left


def test_metrics_count_a_container_restart_when_a_runtime_fault_fails_bootcheck(
    tmp_path: Path,
) -> None:
    """A broken container (``runtime`` injected: it fails in the pod's first container on
    node-2 only) is restarted on the same node at level 2; bootcheck faults are not counted."""
    command = (sys.executable, str(TRAIN), "--steps", "6", "--ckpt-every", "2",
               "--ckpt-dir", str(tmp_path / "ckpt"))  # fmt: skip
    run = _run(_settings(tmp_path, command, inject={"node-2": frozenset({"runtime"})}))
    status = run.result.status
    assert status.phase is Phase.SUCCEED, run.result.log_dir
    assert status.recover_count == 0 and status.error_nodes == ()
    assert run.result.placements.count(("obs-2", "node-2")) == 2  # a new container, same node
    after = parse(run.after)
    assert value(after, "aegis_recoveries_total", level="container") == 1
    assert value(after, "aegis_recoveries_total") == 1
    assert value(after, "aegis_recovery_duration_seconds_count", level="container") == 1
    assert value(after, "aegis_check_failures_total", check="runtime", round="bootcheck") == 1
    # two bootcheck rounds of three pods, in one stay in BootChecking (the bootcheck total)
    assert (
        value(after, "aegis_check_duration_seconds_count", check="runtime", round="bootcheck") == 6
    )
    assert value(after, "aegis_round_duration_seconds_count", round="bootcheck") == 1
    assert value(after, "aegis_faults_total", counted="true") == 0


def test_dashboard_queries_only_metrics_that_a_real_scrape_has(gpu_run: Run) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\baegis_[a-z_]+", target["expr"])
    }
    assert len(queried) >= 10
    scraped = {name for name, _ in parse(gpu_run.after)}
    assert queried - scraped == set()


# -- fault log, status, incidents --------------------------------------------------------------


def test_fault_log_has_seed_fields_and_one_incident_when_crash_then_gpu_fault(gpu_run: Run) -> None:
    lines = [json.loads(line) for line in (gpu_run.result.log_dir / "faults.jsonl").open()]
    fields = {"pod", "pod_ip", "node", "node_ip", "ts", "phase", "message", "job", "incident",
              "level", "kind"}  # fmt: skip
    assert all(fields <= set(line) for line in lines)
    assert {line["kind"] for line in lines} == {"phase_start", "phase_end", "report", "decision"}
    assert {line["incident"] for line in lines} == {None, "obs#1"}
    evict = [line for line in lines if line["message"].startswith("evict (level 3)")]
    assert [(e["pod"], e["node"], e["level"]) for e in evict] == [
        ("obs-1", "node-1", "node_replaced")
    ]
    reports = [(line["pod"], line["message"]) for line in lines if line["kind"] == "report"]
    # (on a loaded machine allreduce_perf may add its own verdict after the gpu one)
    assert any(
        pod == "obs-1" and text.startswith("checks failed: gpu: injected fault")
        for pod, text in reports
    ), reports


def test_status_prints_the_user_line_when_crash_then_gpu_fault(gpu_run: Run) -> None:
    log_dir = str(gpu_run.result.log_dir)
    out = aegis("status", "obs", "--log-dir", log_dir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "job obs: Succeed"
    assert lines[1] == "max restarts 2, restarted 1 times; hardware problems rescheduled 1 times"
    assert "error nodes: node-1" in out.stdout
    assert re.search(r"obs-1\s.*spare-0\s.*Succeed\s.*1\s.*gpu: injected fault", out.stdout)
    data = json.loads(aegis("status", "obs", "--log-dir", log_dir, "--json").stdout)
    assert data["hardware_rescheduled"] == 1 and data["status"]["phase"] == "Succeed"
    assert [p["retries"] for p in data["pods"]] == [1, 1, 1]


def test_incidents_show_evidence_and_level_when_crash_then_gpu_fault(gpu_run: Run) -> None:
    out = aegis("incidents", "obs", "--log-dir", str(gpu_run.result.log_dir), "--json")
    assert out.returncode == 0, out.stderr
    (incident,) = json.loads(out.stdout)
    # rank 0 exits (no traceback); its peers' gloo errors may reach the master first: either
    # opens it
    assert incident["id"] == "obs#1" and incident["pod"] in {"obs-0", "obs-1", "obs-2"}
    assert incident["detected_by"] == "agent error report" and incident["counted"]
    assert incident["level"] == "node_replaced" and incident["outcome"] == "RunCommand"
    assert incident["recovery_s"] > 0
    logs = {e["pod"]: e["lines"] for e in incident["evidence"] if e["kind"] == "log"}
    assert incident["pod"] in logs and all(logs.values())
    if "obs-0" in logs:
        assert any("injected exit of rank 0" in line for line in logs["obs-0"])
    failing = [e for e in incident["evidence"] if e["summary"].startswith("failed: gpu")]
    assert [e["pod"] for e in failing] == ["obs-1"]
    assert "gpu: FAIL (0.00 s) injected fault" in failing[0]["lines"]
    assert incident["classification"]["obs-1"].startswith("hardware")
    texts = [d["text"] for d in incident["decisions"]]
    assert any(t.startswith("obs-1: leaves its node, level 3 node_replaced") for t in texts)
    assert texts[-1] == "restart every pod in place"
    human = aegis("incidents", "obs", "--log-dir", str(gpu_run.result.log_dir)).stdout
    assert human.startswith("incident obs#1: ")
    assert "level: node_replaced; RunCommand after" in human


@pytest.mark.timing
def test_status_and_incidents_when_hangs_exhaust_the_budget(hang_run: Run) -> None:
    result = hang_run.result
    assert result.status.phase is Phase.FAILED and result.status.should_quit, result.log_dir
    out = aegis("status", "stuck", "--log-dir", str(result.log_dir))
    assert out.stdout.splitlines()[:2] == [
        "job stuck: Failed: fault budget exhausted",
        "max restarts 1, restarted 1 times; hardware problems rescheduled 0 times",
    ]
    found = json.loads(aegis("incidents", "stuck", "--log-dir", str(result.log_dir),
                             "--json").stdout)  # fmt: skip
    assert [i["id"] for i in found] == ["stuck#1", "stuck#2"]
    assert all(i["detected_by"] == "hang watchdog (no progress)" for i in found)
    assert found[0]["level"] == "in_place" and found[0]["outcome"] == "RunCommand"
    assert found[1]["outcome"] == "Failed" and found[1]["level"] is None
    stacks = [e for i in found for e in i["evidence"] if e["kind"] == "stacks"]
    assert stacks and all(e["summary"].startswith("no progress for") for e in stacks)
    assert any("stuck_in_allreduce" in "\n".join(e["lines"]) for e in stacks)
    assert found[1]["decisions"][-1]["text"].startswith("job Failed")
    after = parse(hang_run.after)
    assert value(after, "aegis_jobs_failed_total", worker_num="2") == 1
    assert value(after, "aegis_faults_total", detector="hang", counted="true") == 2
    assert value(after, "aegis_recoveries_total", level="in_place") == 1


# -- the run's views ---------------------------------------------------------------------------


def test_live_view_records_the_final_table_when_crash_then_gpu_fault(gpu_run: Run) -> None:
    text = gpu_run.live
    assert "job obs Succeed" in text
    assert "max restarts 2, restarted 1 times; hardware problems rescheduled 1 times" in text
    assert re.search(r"obs-1 .*spare-0 .*Succeed", text)
    assert "error nodes: node-1" in text


def test_plain_view_prints_timestamped_lines_when_not_a_tty(gpu_run: Run) -> None:
    lines = gpu_run.plain.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d\.\d{3} aegis: ", line) for line in lines)
    assert any("decision: obs-1 leaves its node (level 3)" in line for line in lines)
    assert lines[-1].endswith("phase Succeed: recover_count 1, retries (1,1,1)")
