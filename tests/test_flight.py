"""torch's flight recorder on a hang: each process answers the agent's request from a thread
(its main thread is blocked in a collective or asleep), the agent sums each dump up in a line,
and the pod that enqueued fewer collectives than the others is named (real gloo processes
started with Aegis's ``sitecustomize``; the rule itself on dumps of the shape torch writes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aegis import autoprogress, flight, training
from aegis.agent import stacks
from aegis.core import suspects
from aegis.spawn.ports import free_port
from tests.waits import wait_until

SCRIPT = Path(__file__).parent / "bin" / "plain_allreduce.py"


def _dump(enqueued: int, completed: int, name: str = "gloo:all_reduce") -> dict[str, object]:
    entry = {"pg_id": 0, "profiling_name": name, "state": "scheduled", "collective_seq_id": 4}
    return {
        "version": "2.10",
        "pg_status": {
            "0": {
                "last_enqueued_collective": str(enqueued),
                "last_completed_collective": str(completed),
                "last_started_collective": "-1",
            }
        },
        "entries": [entry],
    }


def _report(*lines: str) -> str:
    return "".join(f"--- pid {i} (python train.py) ---\n  wait (x.py:1)\n{line}\n"
                   for i, line in enumerate(lines))  # fmt: skip


def test_a_dump_is_summed_up_in_one_line() -> None:
    line = suspects.flight_line(_dump(4, 3))
    assert line == (
        "flight recorder: collective #4 enqueued, #3 completed (newest gloo:all_reduce, scheduled)"
    )
    assert suspects.flight_line({"pg_status": {}}) == ""
    assert suspects.flight_line({"pg_status": {"0": "junk"}}) == ""


_VALID = _dump(4, 3)
_STATUS = _VALID["pg_status"]


@pytest.mark.parametrize(
    "dump",
    [
        {**_VALID, "entries": 7},
        {**_VALID, "entries": "scheduled"},
        {**_VALID, "entries": {"pg_id": 0}},
        {**_VALID, "entries": [1, 2]},
        {**_VALID, "pg_status": {"0": [4, 3]}},
        {**_VALID, "pg_status": {"0": {"last_enqueued_collective": float("inf")}}},
        {**_VALID, "pg_status": {"0": {"last_completed_collective": [1]}}},
        {**_VALID, "pg_status": [_STATUS]},
    ],
)
def test_a_malformed_dump_is_no_line_when_summed_up(dump: dict[str, object]) -> None:
    assert suspects.flight_line(dump) == ""


def test_malformed_answers_are_none_when_the_agent_reads_them(tmp_path: Path) -> None:
    """The job writes the answers: the watchdog reading them must not die of any (it did on
    ``"entries": 7``, and would on JSON nested too deep for the parser)."""
    request = str(tmp_path / "progress.fr")
    answers = {
        1: json.dumps({**_VALID, "entries": 7}).encode(),
        2: b"[" * 100_000,
        3: b"\xff\xfe{",
        4: json.dumps({"pg_status": {"0": {"last_enqueued_collective": 1e999}}}).encode(),
        5: json.dumps({**_VALID, "entries": None}).encode(),  # no entries: still a line
    }
    for pid, text in answers.items():
        Path(flight.dump_path(request, pid)).write_bytes(text)
    got = asyncio.run(stacks.read_flight(request, list(answers), wait_s=0.0))
    assert got == {5: "flight recorder: collective #4 enqueued, #3 completed"}


def test_the_pod_that_enqueued_fewer_collectives_is_named() -> None:
    ahead, behind = suspects.flight_line(_dump(413, 412)), suspects.flight_line(_dump(412, 412))
    reports = {"j-0": _report(ahead), "j-1": _report(behind), "j-2": _report(ahead, ahead)}
    named = suspects.name_suspect(reports, ["j-0", "j-1", "j-2"])
    assert named == suspects.Suspect(
        "j-1", "enqueued collective #412 while 2 other pods enqueued #413 (flight recorder)"
    )
    # a pod is as far as its slowest process
    reports["j-2"] = _report(ahead, behind)
    assert suspects.name_suspect(reports, ["j-0", "j-1", "j-2"]) is None  # two behind: no one


def test_recording_follows_torchs_variables() -> None:
    assert flight.recording({"TORCH_FR_BUFFER_SIZE": "2000"})
    assert flight.recording({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"})
    assert not flight.recording({"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": "9"})
    assert not flight.recording({"TORCH_FR_BUFFER_SIZE": "lots"})
    assert not flight.recording({})


@pytest.mark.timeout(120)
@pytest.mark.timing
def test_real_ranks_answer_from_a_thread_while_one_hangs_and_it_is_named(tmp_path: Path) -> None:
    world, port = 3, free_port()
    procs, requests = [], []
    for rank in range(world):
        progress = tmp_path / f"progress-{rank}"
        progress.write_bytes(b"\0" * training.SIZE)
        request = str(tmp_path / f"progress-{rank}.fr")
        requests.append(request)
        env = {
            **os.environ,
            "RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCH_FR_BUFFER_SIZE": "200",
            training.ENV_VAR: str(progress), flight.REQUEST_VAR: request,
            autoprogress.PATH_VAR: autoprogress.SITE_DIR,
        }  # fmt: skip
        argv = [sys.executable, str(SCRIPT), "--steps", "100000", "--step-time-s", "0.001",
                "--hang-at-step", "30", "--hang-rank", "1",
                "--state-dir", str(tmp_path)]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))

    def hung() -> bool:
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        return (tmp_path / ".hung-rank-1").exists()

    try:
        wait_until(hung, 90, "rank 1 to hang")
        lines: dict[int, str] = {}
        for proc, request in zip(procs, requests, strict=True):
            stacks.ask_flight(request, [proc.pid])
        for rank, (proc, request) in enumerate(zip(procs, requests, strict=True)):
            got = asyncio.run(stacks.read_flight(request, [proc.pid], wait_s=30))
            lines[rank] = got.get(proc.pid, "")
        assert all(lines.values()), lines  # every process answered, the blocked ones too
        reports = {f"j-{rank}": _report(line) for rank, line in lines.items()}
        named = suspects.name_suspect(reports, list(reports))
        assert named is not None and named.pod == "j-1", lines
        assert "flight recorder" in named.why
        for request in requests:
            stacks.remove_flight_files(request)
        assert sorted(p.name for p in tmp_path.iterdir() if ".fr" in p.name) == []
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
