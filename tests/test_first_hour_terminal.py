"""The live view on a real terminal (tmux): through a fault and a node move, with log lines
printed while the table is shown, the screen and its scrollback hold one header and one table,
the last ones; no stale copy left behind by a refresh (issue 19).

The job: 2 pods, rank 1 exits 13 with no traceback at step 15 (unexplained: the checks run),
node-1's gpu check is broken (injected), so its pod moves to the spare node; ``--verbose``
makes the master log while the table is up (what used to leave stale lines: a log line written
to stderr under rich's ``Live``). ``tmux capture-pane`` reads the screen as a person sees it;
``pipe-pane`` shows that the table was redrawn in place while the job ran.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import waits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

ROOT = Path(__file__).parent.parent
TRAIN = ROOT / "examples" / "train_ddp.py"


def _tmux(socket: str, *args: str) -> str:
    # the terminal's size is the pane's: no COLUMNS or LINES of ours (rich would believe them)
    env = {k: v for k, v in os.environ.items() if k not in {"COLUMNS", "LINES", "TMUX"}}
    out = subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True,
                         timeout=30, check=True, env=env)  # fmt: skip
    return out.stdout


def test_live_view_leaves_one_header_and_one_table_through_a_fault_and_a_node_move(
    tmp_path: Path,
) -> None:
    conf, rc_file, status_file = tmp_path / "tmux.conf", tmp_path / "rc", tmp_path / "status.json"
    conf.write_text("set -g remain-on-exit on\nset -g history-limit 20000\n")
    run = [
        sys.executable, "-m", "aegis", "run", "--verbose", "--view", "live", "--nodes", "2",
        "--spare-nodes", "1", "--max-retry", "2", "--job", "demo", "--inject-fault",
        "node-1:gpu", "--total-steps", "40", "--log-dir", str(tmp_path / "logs"),
        "--status-file", str(status_file), "--",
        sys.executable, str(TRAIN), "--steps", "40", "--ckpt-every", "10",
        "--ckpt-dir", str(tmp_path / "ckpt"), "--exit-at-step", "15", "--exit-rank", "1",
        "--step-time-s", "0.05",
    ]  # fmt: skip
    shell = f"cd {ROOT} && {subprocess.list2cmdline(run)}; echo $? > {rc_file}"
    socket = f"aegis-test-{tmp_path.name}"
    _tmux(socket, "-f", str(conf), "new-session", "-d", "-s", "run", "-x", "150", "-y", "50",
          shell)  # fmt: skip
    raw = tmp_path / "raw.txt"  # what the program wrote to its terminal, escapes and all
    try:
        _tmux(socket, "pipe-pane", "-t", "run", "-o", f"cat >> {raw}")
        waits.wait_until(rc_file.exists, 540, "the run to end in its terminal")
        screen = _tmux(socket, "capture-pane", "-p", "-t", "run", "-S", "-", "-E", "-")
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, check=False)
    (tmp_path / "screen.txt").write_text(screen)  # for a person, when it fails
    assert rc_file.read_text().strip() == "0", screen
    # the table was live: redrawn in place (cursor up, erase line), not printed once at the end
    assert "\x1b[1A\x1b[2K" in raw.read_text(errors="replace")
    status = json.loads(status_file.read_text())["status"]
    assert [e["node"] for e in status["error_nodes"]] == ["node-1"], status
    assert status["pod_infos"]["demo-1"]["node"] == "spare-0"  # moved
    lines = screen.splitlines()
    logged = [line for line in lines if " INFO " in line or " WARNING " in line]
    # rank 1's exit, or a peer's gloo error if it reaches the master first: a WARNING anyway
    assert any(" WARNING " in line and "fault of demo-" in line for line in logged), screen
    headers = [line for line in lines if line.startswith("job demo ")]
    assert len(headers) == 1 and headers[0].startswith("job demo Succeed "), screen
    assert sum(line.startswith("┏") for line in lines) == 1, screen
    assert lines.index(headers[0]) > max(lines.index(line) for line in logged)  # logs above
