"""``aegis replay``: status after each event; a bad line is one readable error and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aegis.cli import main as cli
from aegis.platforms import follow
from aegis.tools import replay
from aegis.wire import eventlog

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
        "software_restart": False,  # a log without the field: the rules before it existed
        "repeat_limit": 0,  # likewise: no restart-or-stop
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
    path.write_text("".join(f"{header if line == 'HEADER' else line}\n" for line in lines))
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


def test_a_followed_log_reaches_the_replayed_status_whatever_the_pieces_it_is_written_in(
    tmp_path: Path,
) -> None:
    """``FollowedJob`` (the view of ``aegis run --masters N``) reads a log as the leader
    appends it: half lines wait for their end, a bad line is skipped and counted, and every
    event reaches the listeners with the status the replay gives."""
    text = TRACE.read_text()
    lines = text.splitlines(keepends=True)
    path = tmp_path / "events.jsonl"
    path.write_text(lines[0])
    job = follow.FollowedJob.open(path)
    seen: list[tuple[str, str]] = []
    job.listeners.append(
        lambda j, event, actions: seen.append((type(event).__name__, j.status.phase.value))
    )
    rest = "".join(lines[1:4]) + "{not json\n" + "".join(lines[4:])
    with path.open("a") as log_file:
        for cut in range(0, len(rest), 97):  # pieces that end mid-line
            log_file.write(rest[cut : cut + 97])
            log_file.flush()
            job.poll()
    assert job.bad_lines == 1
    _, expected = replay.final_status(text.splitlines())
    assert job.status == expected
    _, _, steps = replay.replay(text.splitlines())
    assert seen == [(type(s.entry.event).__name__, s.status.phase.value) for s in steps]


def test_following_a_log_without_its_header_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(TRACE.read_text().splitlines()[0])  # no newline yet: not a whole line
    with pytest.raises(eventlog.EventLogError, match="line 1"):
        follow.FollowedJob.open(path)


def test_a_failing_listener_does_not_stop_the_followed_log(tmp_path: Path) -> None:
    lines = TRACE.read_text().splitlines(keepends=True)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(lines))
    job = follow.FollowedJob.open(path)
    seen: list[str] = []

    def broken(j: follow.FollowedJob, event: object, actions: object) -> None:
        raise RuntimeError("a view bug")

    job.listeners += [broken, lambda j, event, actions: seen.append(type(event).__name__)]
    assert job.poll() == len(lines) - 1
    assert len(seen) == len(lines) - 1 and job.status.phase.value == "Failed"


def test_a_log_of_the_software_restart_rule_replays_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same worked example logged under today's rule: the exception at line 14 restarts
    in place at once, and the troubleshooting answers that followed it in the old log are
    refused as stale: the rule a log was made under is the one it replays with."""
    lines = TRACE.read_text().splitlines()
    lines[0] = lines[0].replace('"max_retry":2}', '"max_retry":2,"software_restart":true}')
    trace = tmp_path / "events.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert cli.main(["replay", str(trace), "--json"]) == 0
    records = {r["line"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert records[14]["actions"] == "fault of llama-1 counted; order restart#6 -> all"
    assert records[14]["status"]["phase"] == "RunCommand"
    assert all(records[n]["actions"].startswith("rejected (stale") for n in (15, 16, 17))


def _with_reason(reason: str) -> str:
    """The worked example with line 14's exception message replaced by ``reason``."""
    return TRACE.read_text().replace("RuntimeError in train step", reason)


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_reason_holding_a_unicode_line_separator_stays_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], separator: str
) -> None:
    """A pod's exception message is logged as it came (msgspec writes U+2028 and U+0085 raw):
    the log is still one event per ``\\n``, for replay and for status alike."""
    (tmp_path / "events.jsonl").write_text(_with_reason(f"bad token {separator} in step"))
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == len(TRACE.read_text().splitlines()) - 1
    assert records[-1]["status"]["phase"] == "Failed"
    assert cli.main(["status", "llama", "--log-dir", str(tmp_path)]) == 0
    assert "Failed" in capsys.readouterr().out


@pytest.mark.parametrize("cut", [1, 40, -2])
def test_a_torn_last_line_is_left_out_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: int
) -> None:
    """The master stopped (or is) writing the last line: status and replay show the job as of
    the line before, and say on stderr that the tail was left out."""
    lines = TRACE.read_text().splitlines(keepends=True)
    (tmp_path / "events.jsonl").write_text("".join(lines[:-1]) + lines[-1][:cut])
    _, before = replay.final_status([line.rstrip("\n") for line in lines[:-1]])
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    assert records[-1]["line"] == len(lines) - 1
    assert records[-1]["status"]["phase"] == before.phase.value
    assert captured.err.count("\n") == 1 and "incomplete" in captured.err
    assert cli.main(["status", "llama", "--log-dir", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"]["phase"] == before.phase.value
    assert "incomplete" in captured.err and "left out" in captured.err


def test_a_last_whole_record_without_its_newline_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hand-written trace may end without a newline: its last record still counts."""
    (tmp_path / "events.jsonl").write_text(TRACE.read_text().rstrip("\n"))
    assert cli.main(["replay", str(tmp_path), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.splitlines()[-1])["status"]["phase"] == "Failed"
    assert captured.err == ""
