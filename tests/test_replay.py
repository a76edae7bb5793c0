"""``aegis replay``: status after each event; a bad line is one readable error and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aegis.cli import main as cli

TRACE = Path(__file__).parent.parent / "examples" / "traces" / "seed-worked-example.jsonl"


def test_replay_prints_a_table_per_event_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(TRACE)]) == 0
    out = capsys.readouterr().out
    assert out.count("line ") == len(TRACE.read_text().splitlines()) - 1
    assert "phase=Failed recover_count=3 retries=(2,2,3)" in out


def test_replay_json_gives_one_status_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(TRACE), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[-1]["status"]["phase"] == "Failed"
    assert records[-1]["status"]["recover_count"] == 3
    assert [p["retries"] for p in records[-1]["status"]["pod_infos"].values()] == [2, 2, 3]
    assert records[0]["spec"] == {
        "job": "llama",
        "namespace": "default",
        "worker_num": 3,
        "max_retry": 2,
    }


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (["{not json"], "line 1: not JSON"),
        (['{"type": "HeartbeatLost", "pod": "x", "ts": 1}'], "line 1: the first line must be"),
        (["HEADER", '{"type": "PodRestarted"}'], "line 2:"),
        (["HEADER", '{"type": "Finish", "job": "llama"}'], "line 2:"),
        (["HEADER", "HEADER"], "line 2: a second JobCreated"),
        ([], "line 1: empty event log"),
    ],
)
def test_replay_bad_line_gets_line_number_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str], expected: str
) -> None:
    header = TRACE.read_text().splitlines()[0]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(header if line == "HEADER" else line for line in lines))
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0]


def test_replay_of_missing_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_replay_accepts_a_log_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "events.jsonl").write_text(TRACE.read_text())
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
