"""Peer text on the operator's terminal: a traceback line or a check's result that carries
escape sequences (clear the screen, set the title, a C1 CSI, a bidi override) is shown escaped
by ``aegis replay``, ``aegis status``, ``aegis incidents``, both views of ``aegis run`` and
its log lines; the text itself stays readable."""

from __future__ import annotations

import io
import logging
import types
from pathlib import Path

import pytest
from rich.console import Console

from aegis.cli import live_view, run_cmd, run_view
from aegis.cli import main as cli
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.model import JobSpec, NodeName, PodName, initial_status
from aegis.wire.logsafe import one_line, terminal_safe

TRACE = Path(__file__).parent.parent / "examples" / "traces" / "seed-worked-example.jsonl"
HOSTILE = "\x1b[2J\x1b]0;owned\x07\u202e\x9b\r"
SHOWN = r"\x1b[2J\x1b]0;owned\x07\u202e\x9b\r"
RAW = ("\x1b", "\x07", "\u202e", "\x9b", "\r")


def test_terminal_safe_escapes_what_is_not_printable_and_keeps_the_rest() -> None:
    assert terminal_safe(f"step 7{HOSTILE}") == f"step 7{SHOWN}"
    kept = "训练 step 7: ValueError('x')\n\tat line 3 \\ done"
    assert terminal_safe(kept) == kept
    assert terminal_safe("\x00\x7f\u2066") == r"\x00\x7f\u2066"


def test_one_line_escapes_newlines_too_and_says_what_it_cut() -> None:
    assert one_line(f"a\n\tb{HOSTILE}") == rf"a\n\tb{SHOWN}"
    assert one_line("训练 step 7 \\ done") == "训练 step 7 \\ done"
    assert one_line("x" * 10 + "\n", limit=4) == "xxxx... (11 characters)"


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    """The worked example, whose llama-1 crash says more than it should."""
    text = TRACE.read_text()
    assert '"RuntimeError in train step"' in text
    hostile = HOSTILE.encode("unicode_escape").decode().replace("\\x", "\\u00")
    (tmp_path / "events.jsonl").write_text(
        text.replace('"RuntimeError in train step"', f'"RuntimeError in train step{hostile}"')
    )
    return tmp_path


@pytest.mark.parametrize(
    "argv",
    [["replay", "{dir}/events.jsonl"], ["status", "llama", "--log-dir", "{dir}"],
     ["incidents", "llama", "--log-dir", "{dir}"]],
    ids=["replay", "status", "incidents"],
)  # fmt: skip
def test_the_commands_show_a_peers_escape_sequences_escaped(
    log_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # the table's cell whole on one line
    assert cli.main([arg.format(dir=log_dir) for arg in argv]) == 0
    out = capsys.readouterr().out
    assert not [c for c in RAW if c in out], out
    assert r"\x1b[2J" in out and r"\u202e" in out  # escaped, not dropped


def test_the_live_view_shows_a_peers_escape_sequences_escaped() -> None:
    spec = JobSpec("demo", "default", 2, 2)
    status = initial_status(spec, [NodeName("node-0"), NodeName("node-1")])
    state = live_view.ViewState(spec, status, total_steps=None, started=0.0)
    state.last_event["demo-1"] = (0.0, f"error: {HOSTILE}")
    console = Console(file=io.StringIO(), width=200, force_terminal=True, record=True)
    console.print(live_view.render(state, now=1.0))
    handler = live_view.ConsoleLogHandler(console)
    handler.emit(logging.makeLogRecord({"msg": f"from a peer: {HOSTILE}"}))
    text = console.export_text(styles=False)
    assert not [c for c in RAW if c in text], text
    assert text.count(r"\x1b[2J") == 2


def test_the_plain_view_shows_a_peers_escape_sequences_escaped() -> None:
    spec = JobSpec("demo", "default", 2, 2)
    out = io.StringIO()
    view = run_view.PlainView(out)
    runner = types.SimpleNamespace(status=initial_status(spec, [NodeName("n0"), NodeName("n1")]))
    record = act.RecordFault(pod=PodName("demo-1"), reason=f"boom{HOSTILE}", counted=True)
    view.on_event(runner, ev.SlowdownReported(f"slow{HOSTILE}"), (record,))  # type: ignore[arg-type]
    assert not [c for c in RAW if c in out.getvalue()], out.getvalue()
    assert f"fault: demo-1: boom{SHOWN} (counted)" in out.getvalue()


def test_the_log_lines_of_a_plain_run_show_a_peers_escape_sequences_escaped() -> None:
    handler = run_cmd.log_handler(run_view.PlainView(io.StringIO()), verbose=True)
    assert isinstance(handler, logging.StreamHandler)
    assert isinstance(handler.stream, run_view.TerminalSafeStream)
    out = io.StringIO()
    handler.stream.inner = out
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(logging.makeLogRecord({"msg": "job %s: fault of %s (%s)",
                                        "args": ("demo", "demo-1", f"boom{HOSTILE}")}))  # fmt: skip
    assert out.getvalue() == f"job demo: fault of demo-1 (boom{SHOWN})\n"
