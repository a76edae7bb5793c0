"""``aegis run`` as a user starts it, watched from outside: ``/metrics`` over real HTTP while the
job runs (one master in the process, or master replicas in their own processes), the view's
lines, the fault log, and nothing left listening afterwards."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest

from aegis.spawn.ports import free_port
from tests.scrape import parse, scrape, value
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

AEGIS = [sys.executable, "-m", "aegis.cli.main"]


def _script(tmp: Path) -> str:
    """Rank 0 crashes once; then every rank waits for the test's ``go`` file and succeeds."""
    return (
        f'if [ "$RANK" = 0 ] && [ ! -e {tmp}/crashed ]; then touch {tmp}/crashed; exit 3; fi; '
        f"while [ ! -e {tmp}/go ]; do sleep 0.05; done"
    )


def _start(tmp: Path, *options: str) -> subprocess.Popen[str]:
    argv = [*AEGIS, "run", "--nodes", "2", "--view", "plain", "--log-dir", str(tmp / "logs"),
            "--grace-s", "2", *options, "--", _script(tmp)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _scrape_or_empty(port: int) -> str:
    try:
        return scrape(port)
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
        # not serving (yet, or this replica is not up); a port nobody listens on can even
        # connect to itself and read back the request (BadStatusLine: "GET /metrics HTTP/1.1")
        return ""


def _recovered_and_running(text: str) -> bool:
    samples = parse(text) if text else {}
    return (
        value(samples, "aegis_recoveries_total", level="in_place") == 1
        and value(samples, "aegis_jobs", phase="RunCommand") == 1
    )


def _finish(proc: subprocess.Popen[str], tmp: Path) -> tuple[str, str]:
    (tmp / "go").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    return out, err


def test_aegis_run_serves_metrics_while_the_job_runs_and_stops_serving_after(
    tmp_path: Path,
) -> None:
    port = free_port()
    proc = _start(tmp_path, "--metrics-port", str(port))
    try:
        seen: list[str] = []

        def recovered() -> bool:
            seen.append(_scrape_or_empty(port))
            return _recovered_and_running(seen[-1])

        wait_until(recovered, timeout_s=90, what="a scrape after the in-place recovery")
        running = parse(seen[-1])
        assert value(running, "aegis_pods", inner_phase="RunCommand") == 2
        assert value(running, "aegis_jobs_created_total", worker_num="2") == 1
        assert value(running, "aegis_faults_total", detector="error", counted="true") == 1
        assert value(running, "aegis_jobs_succeeded_total") == 0
        out, _ = _finish(proc, tmp_path)
    finally:
        proc.kill()
        proc.wait()
    assert "phase Succeed: recover_count 1" in out
    assert _scrape_or_empty(port) == ""  # the run's server is gone with it


def test_aegis_run_with_two_masters_shows_the_view_and_serves_the_leaders_metrics(
    tmp_path: Path,
) -> None:
    port = free_port()
    proc = _start(tmp_path, "--masters", "2", "--metrics-port", str(port))
    try:
        leader: list[str] = []

        def a_replica_reports_the_recovery() -> bool:
            leader[:] = [t for t in map(_scrape_or_empty, (port, port + 1)) if t][:2]
            return any(_recovered_and_running(t) for t in leader)

        wait_until(a_replica_reports_the_recovery, timeout_s=120, what="the leader's scrape")
        out, err = _finish(proc, tmp_path)
    finally:
        proc.kill()
        proc.wait()
    assert f"/metrics on 127.0.0.1 (master-0 :{port}, master-1 :{port + 1})" in err
    # the view follows the leader's event log: the same lines as with one master
    lines = out.splitlines()
    assert any("aegis: job job: 2 pods, max_retry 3" in line for line in lines), out
    assert any("aegis: fault: job-0: " in line and "(counted)" in line for line in lines), out
    assert any("aegis: phase RunCommand: recover_count 1, retries (1,1)" in line for line in lines)
    assert any("aegis: phase Succeed: recover_count 1" in line for line in lines), out
    assert "aegis run: job job Succeed; recover_count 1/3" in lines[-1]
    # the masters wrote the fault log into the run's log directory
    faults = [json.loads(line) for line in (tmp_path / "logs" / "faults.jsonl").open()]
    assert any(f["pod"] == "job-0" and f["kind"] == "report" for f in faults), faults
    assert _scrape_or_empty(port) == "" and _scrape_or_empty(port + 1) == ""
    # the leader kept the job's own event log (logs/default/job/): the run's directory is
    # enough for aegis status and incidents
    status = subprocess.run([*AEGIS, "status", "job", "--log-dir", str(tmp_path / "logs")],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert (
        "max restarts 3, restarted 1 times; hardware problems rescheduled 0 times" in status.stdout
    )
    assert (tmp_path / "logs" / "default" / "job" / "events.jsonl").is_file()
