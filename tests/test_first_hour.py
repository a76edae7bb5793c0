"""What a user notices in the first hour (issue 19), where it is produced: the words of
``aegis replay``, incident ids that no pod can have, log lines that do not repeat the view's,
and the one-line hint of ``aegis operator`` without the ``kubernetes`` extra."""

from __future__ import annotations

import importlib
import inspect
import io
import json
import logging
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from rich.console import Console

from aegis.cli import live_view, operator_cmd, render, run_cmd, run_view
from aegis.cli import main as cli
from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.incidents import IncidentTracker
from aegis.core.model import name_problem
from aegis.tools import incidents as incidents_tool
from aegis.tools import replay
from tests.core_helpers import Driver, rejected

ROOT = Path(__file__).parent.parent
TRACE = ROOT / "examples" / "traces" / "seed-worked-example.jsonl"
BOOT = 7  # JobCreated, 3 ACKs, 3 bootcheck Finishes: RunCommand, round 2


def _trace_to_running_then(tmp_path: Path, *extra: dict[str, object]) -> Path:
    lines = TRACE.read_text().splitlines()[:BOOT] + [json.dumps(e) for e in extra]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- aegis replay ------------------------------------------------------------------------------


def test_replay_calls_nothing_rejected_when_checkpoints_commit_with_nobody_to_evict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    late = json.loads(TRACE.read_text().splitlines()[BOOT - 1])  # the last bootcheck answer
    late["ts"] = 1009.0
    path = _trace_to_running_then(
        tmp_path,
        {"type": "CheckpointCommitted", "step": 10, "ts": 1007.0},
        {"type": "CheckpointCommitted", "step": 20, "ts": 1008.0},
        late,  # again, a round later: stale, a real rejection
    )
    assert cli.main(["replay", str(path), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    actions = [(r["event"].split("(")[0], r["actions"]) for r in records[-3:]]
    assert actions == [
        ("CheckpointCommitted", "-"),
        ("CheckpointCommitted", "-"),
        ("ChecksReported", "rejected (stale: BootChecking/1)"),
    ]
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("CheckpointCommitted(step=") == 2 and "ignored" not in out
    assert out.count("-> rejected (stale: BootChecking/1)") == 1


def test_replay_says_no_change_when_a_valid_event_changes_nothing_but_a_commit() -> None:
    d = Driver()
    d.ack_all()  # BootChecking: a slowdown means nothing yet
    slowdown = ev.SlowdownReported("3.1 steps/s")
    ignored = d.feed(slowdown)
    assert rejected(ignored) is act.RejectReason.IGNORED
    assert render.describe_actions(ignored, slowdown) == "no change (slowdown in BootChecking)"
    duplicate = d.feed(ev.PodAcked(d.pod(0)))
    assert rejected(duplicate) is act.RejectReason.DUPLICATE
    assert render.describe_actions(duplicate) == "rejected (duplicate: job-0 already ACKed)"


# -- incident ids ------------------------------------------------------------------------------


def test_incident_ids_are_no_pod_names_and_agree_between_fault_log_and_incidents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, initial, lazily = replay.replay(TRACE.read_text().splitlines())
    steps = list(lazily)
    found = incidents_tool.incidents(spec.job, initial, steps)
    assert [i.id for i in found] == ["llama#1", "llama#2", "llama#3"]
    pods = set(initial.pod_infos)
    assert all(i.id not in pods and name_problem("pod", i.id) is not None for i in found)
    tracker, before, opened = IncidentTracker(spec.job), initial.phase, []
    for done in steps:  # the master's fault log, fed what the master fed it
        assert done.entry.event is not None
        tracker.feed(before, done.entry.event, done.status, done.actions, done.entry.ts)
        if tracker.current is not None and tracker.current.id not in opened:
            opened.append(tracker.current.id)
        before = done.status.phase
    assert opened == [i.id for i in found]
    (tmp_path / "events.jsonl").write_bytes(TRACE.read_bytes())
    assert cli.main(["incidents", "llama", "--log-dir", str(tmp_path)]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("incident")]
    assert [h.split(":")[0] for h in heads] == [f"incident llama#{n}" for n in range(1, 4)]


# -- log lines that repeat the view ------------------------------------------------------------


def test_every_log_line_the_view_shows_is_a_logging_call_of_its_module() -> None:
    """The filter matches message templates: a reworded call would slip through unseen."""
    for logger, template in run_view.SHOWN_BY_THE_VIEW:
        source = inspect.getsource(importlib.import_module(logger))
        assert re.search(r"log\.\w+\(\s*" + re.escape(json.dumps(template)), source), template


NOT_SHOWN = ("aegis.master.job_runner", "job %s: %s silent for %.1f s")  # no view says this


def _emit_warnings(handler: logging.Handler) -> None:
    """What the master and the platform log on a fault and a node move, and a line no view
    shows, through their own loggers."""
    for name, template in [*sorted(run_view.SHOWN_BY_THE_VIEW), NOT_SHOWN]:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        try:
            logger.warning(
                template, *(["demo"] * template.count("%s")), *([5.0] * ("%.1f" in template))
            )
        finally:
            logger.removeHandler(handler)


def test_plain_run_logs_no_line_that_repeats_the_view_unless_verbose() -> None:
    view = run_view.PlainView(io.StringIO())
    quiet, verbose = io.StringIO(), io.StringIO()
    for out, flag in ((quiet, False), (verbose, True)):
        handler = run_cmd.log_handler(view, verbose=flag)
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(out)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        _emit_warnings(handler)
    assert quiet.getvalue().splitlines() == [
        "WARNING aegis.master.job_runner: job demo: demo silent for 5.0 s"
    ]
    assert len(verbose.getvalue().splitlines()) == len(run_view.SHOWN_BY_THE_VIEW) + 1


def test_plain_run_logs_in_the_views_own_shape() -> None:
    """The platform's warnings came in Python logging's shape ("2026-12-07 10:05:47,407
    WARNING aegis.platforms.local: ...") between the view's lines ("10:05:47.150 aegis: phase
    Succeed ..."); now in the view's, with the logger's name only under --verbose."""
    lines = {}
    for flag in (False, True):
        out = io.StringIO()
        handler = run_cmd.log_handler(run_view.PlainView(io.StringIO()), verbose=flag)
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(out)
        _emit_warnings(handler)
        lines[flag] = out.getvalue().splitlines()
    clock = r"\d\d:\d\d:\d\d\.\d{3}"
    assert re.fullmatch(f"{clock} aegis: WARNING job demo: demo silent for 5.0 s", lines[False][0])
    assert all(re.match(f"{clock} aegis: WARNING aegis\\.[a-z_.]+: ", line) for line in lines[True])


def test_live_run_logs_through_the_live_console_above_the_table() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100, record=True)
    view = live_view.LiveView(console)
    handler = run_cmd.log_handler(view, verbose=False)
    assert isinstance(handler, live_view.ConsoleLogHandler) and handler.console is console
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    _emit_warnings(handler)
    assert console.export_text().splitlines() == ["WARNING job demo: demo silent for 5.0 s"]


# -- aegis operator without the kubernetes extra -----------------------------------------------


def test_operator_prints_the_pip_command_when_kopf_is_missing() -> None:
    without_kopf = (
        "import sys; sys.modules['kopf'] = None\n"  # import kopf: ModuleNotFoundError
        "from aegis.cli import main; sys.exit(main.main(['operator']))"
    )
    out = subprocess.run([sys.executable, "-c", without_kopf], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [
        "aegis: error: the operator needs kopf (not installed): pip install 'aegis-ft[kubernetes]'"
    ]


def test_an_import_error_of_our_own_is_no_missing_extra() -> None:
    with pytest.raises(ModuleNotFoundError):
        operator_cmd.missing_extra("the operator", ModuleNotFoundError(name="aegis.nope"))


def test_the_image_installs_extras_that_the_package_declares() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"kopf", "kubernetes"} <= {re.split(r"[<>=\[]", d)[0] for d in extras["kubernetes"]}
    assert any(d.startswith("nvidia-ml-py") for d in extras["gpu"])
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    (spec,) = re.findall(r"pip install [^\n]*'/src\[([a-z,]+)\]'", dockerfile)
    assert set(spec.split(",")) == {"kubernetes", "gpu"}
    assert {"kubernetes", "gpu"} <= set(extras)
    copied = re.findall(r"^COPY (?!--from)(.+) /src/?\S*$", dockerfile, flags=re.MULTILINE)
    assert [c.split() for c in copied] == [["pyproject.toml", "README.md"], ["src"]]
