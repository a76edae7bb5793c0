"""Values a user (or an unset variable) gets wrong, and files that are not what a command reads:
one readable line on stderr and exit 2, nothing started. Each of these was a traceback, and
``--nats ''`` a master that spun for ever, deaf to Ctrl-C (nats-py retried an empty server
list without yielding)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aegis.cli import main as cli
from aegis.core.model import JobSpec
from aegis.wire import eventlog
from tests.test_cli_setup_errors import one_error_line

NATS = "nats://127.0.0.1:9"
CASES = {
    "master-empty-nats": (["master", "--insecure", "--nats", ""], "no NATS server in ''"),
    "master-bad-port": (["master", "--insecure", "--nats", "nats://127.0.0.1:99999"],
                        "not a NATS server URL: 'nats://127.0.0.1:99999'"),
    "run-blank-nats": (["run", "--nats", " ", "--", "true"], "no NATS server in ' '"),
    "status-bad-url": (["status", "j", "--nats", "nats://[::1"], "not a NATS server URL"),
    "status-keys-types": (["status", "j", "--nats", NATS, "--auth-file", "{keys}"],
                          "not the keys `aegis auth init` writes: Expected `str`"),
    "status-keys-empty": (["status", "j", "--nats", NATS, "--auth-file", "{nokeys}"],
                          "not the keys `aegis auth init` writes: no keys in it"),
    "master-keys-seed": (["master", "--nats", NATS, "--auth-file", "{seeds}"],
                         "a seed that is no nkey seed"),
    "ctl-file-list": (["ctl", "stop", "j", "--ctl-file", "{ctl}"],
                      "cannot read control file {ctl}: Expected `object`"),
    "ctl-run-ended": (["ctl", "stop", "j", "--log-dir", "{tmp}"],  # (it repeated the path)
                      "no live run at {tmp}: no control.json there (the run has ended"),
    "status-ctl-gone": (["status", "j", "--ctl-file", "{tmp}/control.json"],
                        "no live run at {tmp}: no control.json there"),
    "status-ctl-type": (["status", "j", "--ctl-file", "{ctl_url}"],
                        "Expected `str`, got `int` - at `$.nats_url`"),
    "agent-signatures": (["agent", "--signatures", "{toml}", "--", "true"],
                         "bad signature file: {toml}"),
    "status-torn-utf8": (["status", "job", "--log-dir", "{log}"], "line 2: not JSON"),
    "incidents-torn-utf8": (["incidents", "job", "--log-dir", "{log}"], "line 2: not JSON"),
    "replay-binary": (["replay", "{binary}"], "line 1: not JSON"),
    "status-huge-job": (["status", "job", "--log-dir", "{huge}"],  # 9 GB of pod names once
                        "line 1: Expected `int` <= 1000000 - at `$.spec.worker_num`"),
    "slurm-job-path": (["slurm", "submit", "--job", "../../escape", "--dry-run", "--", "true"],
                       "job name '../../escape' is not a DNS label"),
    "slurm-job-requeue-room": (["slurm", "submit", "--job", "a" * 61, "--dry-run", "--", "true"],
                               "is longer than 59 characters"),
    "slurm-state-file": (["slurm", "submit", "--state-dir", "{file}", "--", "true"],
                         "{file} is not a directory"),
    "run-prewarm": (["run", "--prewarm", "torch numpy", "--", "true"],
                    "not a module name: 'torch numpy'"),
    "agent-prewarm": (["agent", "--master", "127.0.0.1:9", "--prewarm", "torch,3d", "--",
                       "true"], "not a module name: '3d'"),
    "simulate-nan": (["simulate", "--ckpt-interval", "nan"], "must be > 0"),
    "check-scratch": (["check", "io", "--scratch-dir", "{tmp}/absent"],
                      "{tmp}/absent is not a directory"),
    "check-rank": (["check", "allreduce_connect", "--rank", "5", "--world-size", "2"],
                   "rank 5 of a group of 2"),
    "check-port": (["check", "allreduce_connect", "--master-port", "99999"], "--master-port"),
    "run-metrics-busy": (["run", "--nodes", "1", "--metrics-port", "{busy}", "--", "true"],
                         "cannot serve /metrics on 127.0.0.1:{busy}: Address already in use"),
}  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _files(tmp: Path) -> dict[str, str]:
    made = {
        "keys": '{"operator": 1}',
        "seeds": '{"operator": "SOAB", "system": "x", "account": "y"}',
        "nokeys": "{}",  # (no seeds made new keys)
        "ctl": "[1]",
        "ctl_url": '{"nats_url": 5}',
        "toml": "x = = 1\n",
        "file": "x",
    }
    for name, text in made.items():
        (tmp / name).write_text(text)
    (tmp / "binary").write_bytes(b"\x7fELF\x00\xff")
    log = tmp / "log"
    log.mkdir()
    header = eventlog.encode(eventlog.job_created(JobSpec("job", "default", 1, 1), ["n0"], 1.0))
    torn = b'{"type":"QuitRequested","ts":2.0,"reason":"caf\xc3'  # a crash, mid-character
    (log / "events.jsonl").write_bytes(header + torn + b"\n")  # a line after it: not the tail
    huge = tmp / "huge"
    huge.mkdir()
    pods = b'"worker_num":3000000000'
    (huge / "events.jsonl").write_bytes(header.replace(b'"worker_num":1', pods))
    return {name: str(tmp / name) for name in (*made, "binary", "log", "huge")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_value_or_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], busy_port: int, case: str
) -> None:
    argv, says = CASES[case]
    fill = {**_files(tmp_path), "tmp": str(tmp_path), "busy": str(busy_port)}
    before = sorted(tmp_path.iterdir())
    assert cli.main([a.format(**fill) for a in argv]) == 2
    assert says.format(**fill) in one_error_line(capsys)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def test_replay_of_a_log_with_a_bad_line_mid_character_stops_at_that_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It shows the status up to the bad line, then says which (a torn *last* line, with no
    newline after it, is left out instead: tests/test_replay.py)."""
    log = _files(tmp_path)["log"]
    assert cli.main(["replay", log]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"aegis: error: {log}/events.jsonl: line 2: not JSON "
                                         "(Input data was truncated)"]  # fmt: skip
    assert "initial: phase=Pending" in captured.out


def test_a_job_interpreter_without_torch_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The node checks run in the job's Python: one without torch put every node in ErrorNodes
    ("torch does not import") and the job Failed, though this Python has torch."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    argv = ["run", "--nodes", "1", "--log-dir", str(tmp_path / "logs"), "--", str(python), "-c",
            "pass"]  # fmt: skip
    assert cli.main(argv) == 2
    line = one_error_line(capsys)
    assert f"the node checks run in the job's interpreter, {python}, which has no torch" in line
    assert list((tmp_path / "logs").iterdir()) == []
