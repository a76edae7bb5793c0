"""A job no one tuned for, on the emulated cluster under ``aegis run`` with **default flags**
(no ``--hang-timeout-s``): a rank of a plain script (no aegis import) sleeps forever at a step
while the others wait for it. The calibrated watchdog of every pod fires, the master judges the
hang from all their stacks and blames the right rank (not the first watchdog to fire), no other
node is marked, the job recovers and succeeds. Two scripts: one with a torch optimizer (its steps
reach the watchdog through the step hook: the floor, 30 s; torch's flight recorder on, so the
collectives each rank enqueued name it) and one with no step signal at all (gloo ``all_reduce``
only, rank 0 alone prints: 60 s of silence and an idle CPU; its stacks name it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aegis.core.phases import Phase
from aegis.tools import replay as replay_tool
from tests.cluster import AEGIS, leftovers, run_cluster

pytestmark = [pytest.mark.timing, pytest.mark.slow, pytest.mark.timeout(420)]

BIN = Path(__file__).parent / "bin"


def _incidents(log_dir: Path, job: str) -> str:
    result = subprocess.run([*AEGIS, "incidents", job, "--log-dir", str(log_dir)],
                            check=False, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def _judged(log_dir: Path) -> list[dict[str, Any]]:
    """The master's judgements of hangs, from the event log."""
    lines = (log_dir / "events.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "HangJudged"]


async def test_a_rank_asleep_in_a_script_with_no_step_signal_is_named_and_recovered(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(BIN / "plain_allreduce.py"), "--steps", "300",
               "--busy-s", "0.01", "--hang-at-step", "60", "--hang-rank", "2",
               "--state-dir", str(tmp_path / "state")]  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "4", "--spare-nodes", "1", "--job", "q"],
                            command, timeout_s=360)  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert {e["node"] for e in status["error_nodes"]} <= {"node-2"}, status  # nobody else
    [judged] = _judged(run.log_dir)
    assert judged["pod"] == "q-2" and judged["blame"], judged["reason"]
    reason = judged["reason"]
    assert "suspect: q-2 (rank 2, node node-2): in stuck_forever (plain_allreduce.py)" in reason
    assert "no step signal: 60 s with no output and no CPU use" in reason
    assert sorted(r["pod"] for r in judged["reports"]) == ["q-0", "q-1", "q-2", "q-3"]
    text = _incidents(run.log_dir, "q")
    assert "  suspect: q-2 (rank 2, node node-2): in stuck_forever" in text, text
    assert "wait in all_reduce (distributed_c10d.py)" in text
    for rank in (0, 1, 3):  # healthy pods: never held hung (the checks may still find one
        # slow on a loaded machine: allreduce_perf's own business, not the hang's)
        assert "hang" not in run.pods[f"q-{rank}"]["last_failed_reason"], run.pods
    # every pod's watchdog said how it chose its timeout
    assert {r["why"] for r in judged["reports"]} == {
        "no step signal: 60 s with no output and no CPU use"
    }
    assert leftovers(run.log_dir) == []


async def test_a_rank_asleep_in_a_ddp_script_is_found_by_its_optimizer_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")  # torch's flight recorder on: it decides
    command = [sys.executable, str(BIN / "plain_ddp.py"), "--steps", "400",
               "--ckpt-every", "50", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--hang-at-step", "120", "--hang-rank", "1"]  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "3", "--spare-nodes", "1", "--job", "d"],
                            command, timeout_s=360)  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert {e["node"] for e in status["error_nodes"]} <= {"node-1"}, status
    [judged] = _judged(run.log_dir)
    reason = judged["reason"]
    suspect = "suspect: d-1 (rank 1, node node-1): enqueued collective #"
    assert judged["pod"] == "d-1" and suspect in reason, reason
    # what the others enqueued: all of them, or those whose stacks were in by the window's end
    # (seen at CI's load: "while 1 other pod enqueued #125")
    assert re.search(r"while \d+ other pods? enqueued #", reason), reason
    assert "(flight recorder)" in reason, reason
    assert "floor 30 s" in reason, reason  # the steps calibrated the watchdog
    text = _incidents(run.log_dir, "d")
    assert suspect in text and "flight recorder: collective #" in text, text
    assert leftovers(run.log_dir) == []


def _answers(log_dir: Path, seq: int, *, until: int | None = None) -> dict[str, dict[str, Any]]:
    """pod -> its check results (by check) in the troubleshooting round ``seq``, from the answers
    logged up to line ``until`` (1-based; all of them by default)."""
    answers: dict[str, dict[str, Any]] = {}
    lines = (log_dir / "events.jsonl").read_text().splitlines()
    for number, record in enumerate(map(json.loads, lines), start=1):
        data = record.get("data") or {}
        if until is not None and number > until:
            break
        if (
            record.get("seq") == seq
            and record.get("phase") == "Troubleshooting"
            and "response" in data
        ):
            answers[record["pod"]] = {r["check_type"]: r for r in data["response"]["results"]}
    return answers


def _round_end(log_dir: Path, seq: int) -> int:
    """The line of the event that ended troubleshooting round ``seq``, replayed through the core
    (answers that arrive later are logged too, and ignored)."""
    _, status, steps = replay_tool.replay((log_dir / "events.jsonl").read_text().splitlines())
    for done in steps:
        if (
            status.phase is Phase.TROUBLESHOOTING
            and status.seq == seq
            and (done.status.phase is not Phase.TROUBLESHOOTING or done.status.seq != seq)
        ):
            return done.entry.line
        status = done.status
    raise AssertionError(f"troubleshooting round {seq} never ended")


async def test_a_suspect_whose_own_node_fails_leaves_without_waiting_for_its_peers(
    tmp_path: Path,
) -> None:
    """The suspect's node is checked first: rank 1 hangs and its node's gpu is broken. The
    round the hang starts ends on the suspect's own answer (its gpu failed; it skipped the
    collectives; the others' checks are abandoned, or their answers come late and are ignored),
    the pod moves to the spare, and the next round checks everyone there."""
    command = [sys.executable, str(BIN / "plain_ddp.py"), "--steps", "300", "--quiet",
               "--ckpt-every", "50", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--hang-at-step", "80", "--hang-rank", "1"]  # fmt: skip
    run = await run_cluster(tmp_path, ["--nodes", "3", "--spare-nodes", "1", "--job", "s",
                                       "--inject-fault", "node-1:gpu"],
                            command, timeout_s=360)  # fmt: skip
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    assert [e["node"] for e in status["error_nodes"]] == ["node-1"], status
    assert run.pods["s-1"]["node"] not in ("node-0", "node-1", "node-2"), run.pods
    [judged] = _judged(run.log_dir)
    assert judged["pod"] == "s-1" and judged["blame"], judged["reason"]
    round_seq = judged["seq"] + 1  # the troubleshooting round the hang started
    first = _answers(run.log_dir, round_seq, until=_round_end(run.log_dir, round_seq))
    assert list(first) == ["s-1"], first  # the suspect's answer ended the round
    assert not first["s-1"]["gpu"]["passed"]
    for check in ("allreduce_connect", "allreduce_perf"):
        assert "own checks failed first" in first["s-1"][check]["result"], first["s-1"][check]
    later = [seq for seq in range(round_seq + 1, round_seq + 4) if _answers(run.log_dir, seq)]
    assert later, "no troubleshooting round after the move"
    assert sorted(_answers(run.log_dir, later[0])) == ["s-0", "s-1", "s-2"]
    assert leftovers(run.log_dir) == []


async def test_a_rank_stopped_by_a_signal_is_named_though_py_spy_cannot_read_it(
    tmp_path: Path,
) -> None:
    """Rank 1 of a plain DDP script is stopped (SIGSTOP: a debugger, Ctrl-Z or a freezer would
    do the same). py-spy cannot read a stopped process, so its stack says nothing; its agent
    says the process is stopped (``process state: T``), and the master names that pod while
    the others wait in DDP's backward. Before, the stacks singled nobody out."""
    command = [sys.executable, str(BIN / "plain_ddp.py"), "--steps", "300",
               "--ckpt-every", "50", "--ckpt-dir", str(tmp_path / "ckpt"),
               "--hang-at-step", "80", "--hang-rank", "1", "--hang-how", "stop"]  # fmt: skip
    flags = ["--nodes", "3", "--spare-nodes", "1", "--job", "z", "--hang-timeout-s", "20"]
    run = await run_cluster(tmp_path, flags, command, timeout_s=360)
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 1, status
    [judged] = _judged(run.log_dir)
    reason = judged["reason"]
    assert judged["pod"] == "z-1" and judged["blame"], reason
    assert re.search(r"suspect: z-1 \(rank 1, node node-1\): process \d+ is stopped", reason)
    text = _incidents(run.log_dir, "z")
    assert "process state: T, stopped" in text, text
    assert leftovers(run.log_dir) == []
