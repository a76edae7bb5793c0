"""``aegis replay FILE``: the status after each event of a recorded log."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from aegis.cli import render
from aegis.tools import joblog
from aegis.tools import replay as replay_tool
from aegis.wire import eventlog, status_json


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


def replay(
    file: Annotated[Path, typer.Argument(help="An events.jsonl file (or a log directory).")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, one per event.")] = False,
) -> int:
    """Feed a recorded event log through the core; print the status after each event."""
    path = file / "events.jsonl" if file.is_dir() else file
    try:
        lines, torn = eventlog.whole_lines(path.read_text(errors="replace"))
    except OSError as exc:
        print(f"aegis: error: cannot read {path}: {exc.strerror}", file=sys.stderr)
        raise typer.Exit(2) from None
    if torn:
        print(joblog.torn_note(path, torn), file=sys.stderr)
    out = render.make_console()
    try:
        spec, status, steps = replay_tool.replay(lines)
        if not as_json:
            out.print(
                render.pod_table(spec, status, f"initial: {render.summary_line(spec, status)}")
            )
        for done in steps:
            if as_json:
                record = status_json.to_dict(spec, done.status)
                record["line"] = done.entry.line
                record["event"] = (
                    render.describe_event(done.entry.event) if done.entry.event else ""
                )
                record["actions"] = render.describe_actions(done.actions, done.entry.event)
                print(json.dumps(record))
                continue
            assert done.entry.event is not None
            title = (
                f"line {done.entry.line}: {render.describe_event(done.entry.event)}\n"
                f"  -> {render.describe_actions(done.actions, done.entry.event)}\n"
                f"  {render.summary_line(spec, done.status)}"
            )
            out.print(render.pod_table(spec, done.status, title))
    except eventlog.EventLogError as exc:
        print(f"aegis: error: {path}: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    raise typer.Exit(0)
