"""A slow pod leaves at the script's own save when the script takes no checkpoint requests.

Found on the emulated cluster: node-1's link throttled (``tc ... tbf``: a degraded NIC) under a
plain DDP script that saves its own ``torch.save`` checkpoints and never imports aegis. The pace
watch saw the slowdown and allreduce_perf named node-1 (best pair 0.01x its peers), so its pod
was marked slow, to leave at the next committed checkpoint. The script declined the master's
checkpoint request (it takes none), no checkpoint was ever committed, and the job trained on at
a third of its pace to the end. Now the training side says when the script saved on its own
(``torch.save`` to a file, a distributed checkpoint: ``aegis.autoprogress``), the heartbeats
carry the step once training has gone past it, and the master takes the first such save after
the script declined as the checkpoint the slow pods leave at."""

from __future__ import annotations

import asyncio
import mmap
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aegis import autoprogress
from aegis import training as progress
from aegis.agent import encode, executor, link, link_settings, ports, watchdog
from aegis.core import events as ev
from aegis.core.recovery import Classification
from aegis.master.safe_points import SafePoints
from aegis.wire import messages
from tests.cluster import (
    PLAIN_DDP,
    ClusterRun,
    drain_at_step,
    leftovers,
    run_cluster,
    run_with_a_degraded_link,
)
from tests.core_helpers import Driver
from tests.waits import async_wait_until

SCRIPT = """
import io, sys
import torch
from torch import nn
model = nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def step():
    opt.zero_grad(); model(torch.ones(1, 2)).sum().backward(); opt.step()
out = sys.argv[1]
step(); step()
torch.save(model.state_dict(), io.BytesIO())  # to a buffer: not a checkpoint
step(); step(); step()
torch.save({"model": model.state_dict()}, out + "/ckpt.pt")  # at step 5
import torch.distributed.checkpoint as dcp
step()  # 6: the checkpoint module is loaded by now
dcp.save({"model": model.state_dict()}, checkpoint_id=out + "/dcp")  # at step 6: one save
step()
torch.save({"loss": 0.25, "acc": torch.tensor(0.9)}, out + "/metrics.pt")  # no checkpoint
"""


@pytest.fixture
def shared() -> Iterator[watchdog.ProgressFile]:
    made = watchdog.ProgressFile()
    yield made
    made.close()


def _run(tmp_path: Path, progress_file: str) -> None:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), progress.ENV_VAR: progress_file}
    env["PYTHONPATH"] = autoprogress.pythonpath(env) or ""
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_plain_scripts_own_saves_reach_the_progress_file(
    shared: watchdog.ProgressFile, tmp_path: Path
) -> None:
    _run(tmp_path, shared.path)
    seen = shared.read()
    assert seen is not None and seen[0] == 7
    assert shared.saved() == 6  # the checkpoint at 6 (the one at 5 before it; no metrics dump)
    raw = Path(shared.path).read_bytes()
    assert progress.SAVED.unpack_from(raw, progress.SAVED_AT) == (6, 2)  # two saves, not three


def test_an_older_agents_shorter_file_takes_the_steps_and_no_saves(tmp_path: Path) -> None:
    old = tmp_path / "progress-64"
    old.write_bytes(bytes(64))
    _run(tmp_path, str(old))
    raw = old.read_bytes()
    assert len(raw) == 64 and struct.unpack_from("<q", raw, 0)[0] == 7


def test_a_save_is_told_once_training_has_gone_past_it_and_again_now_and_then(
    shared: watchdog.ProgressFile,
) -> None:
    with open(shared.path, "r+b") as f, mmap.mmap(f.fileno(), progress.SIZE) as m:
        progress.SAVED.pack_into(m, progress.SAVED_AT, 20, 1)
    assert shared.saved() == 20
    assert watchdog.save_behind(20, shared.saved()) is None  # still at the step it saved in
    assert watchdog.save_behind(21, shared.saved()) == 20  # past it: the file is done
    assert watchdog.save_behind(None, 20) is None and watchdog.save_behind(30, None) is None
    saved = ports.Progress(step=21, saved_step=20)
    assert encode.script_saved(saved, None, 1) == m_saved(20)  # new: told
    assert encode.script_saved(saved, 20, 2) is None  # told already
    assert encode.script_saved(saved, 20, encode.WATCHDOG_EVERY_BEATS) == m_saved(20)  # again
    assert encode.script_saved(ports.Progress(step=21), None, 0) is None  # no save at all
    shared.reset()
    assert shared.saved() is None


async def test_a_new_save_is_told_at_once_not_at_the_next_heartbeat() -> None:
    """Heartbeats a minute apart: the save training has gone past is told within seconds,
    after a heartbeat of its own (the master believes a save only below the step it has
    heard), and once."""
    settings = link_settings.LinkSettings("127.0.0.1:1", "ns", "job", "job-1", "t",
                                          heartbeat_s=60.0)  # fmt: skip
    the_link = link.MasterLink(settings)
    sent: list[object] = []

    async def send(kind: object, data: messages.Payload, round_: object = None) -> None:
        sent.append(data)

    the_link.send = send  # type: ignore[method-assign]
    looks = [ports.Progress(step=5)]

    class Training:
        def progress(self) -> ports.Progress:
            return looks[-1]

    beating = asyncio.create_task(executor.beat(the_link, Training()))  # type: ignore[arg-type]
    await async_wait_until(lambda: len(sent) == 1, 10, "the first heartbeat")
    looks.append(ports.Progress(step=21, saved_step=20))
    await async_wait_until(lambda: m_saved(20) in sent, 10, "the save told")
    assert [type(d).__name__ for d in sent] == ["HeartbeatData", "HeartbeatData",
                                                "ScriptSavedData"]  # fmt: skip
    assert sent[1].step == 21  # type: ignore[attr-defined]
    the_link.done.set_result(0)
    await asyncio.wait_for(beating, 10)
    assert len(sent) == 3


def m_saved(step: int) -> messages.ScriptSavedData:
    return messages.ScriptSavedData(step)


def _slow_then_restarted() -> Driver:
    """A job whose pod 2 was named slow by a troubleshooting round: back in RunCommand."""
    job = Driver()
    job.to_running()
    job.feed(ev.SlowdownReported("3.0 steps/s, below 50% of 10.0 steps/s"))
    job.answer_all({2: Classification.SLOW})
    assert job.status.slow_count == 1
    return job


def test_a_slow_pod_leaves_at_the_scripts_first_own_save_after_it_declined() -> None:
    job, safe = _slow_then_restarted(), SafePoints("job")
    a, b, _ = job.pods
    seq = job.status.seq

    def saved(pod: str, seq: int, step: int | None) -> int | None:
        return safe.script_saved(job.status, pod, seq, step, 0.0)

    safe.step_seen(job.status, a, seq, 100, 1.0)  # the heartbeats: a trains at step 100
    assert saved(a, seq, 40) is None  # before any decline: nothing
    assert safe.declined(job.status, b, "no requests", 0.0) is None  # no drain to force
    assert saved(a, seq, 40) is None  # the save it knew of then
    assert saved(a, seq - 1, 60) is None  # a report of the last round
    assert saved(a, seq, None) is None
    assert saved(a, seq, 100) is None  # not past it yet: not believed
    assert saved(a, seq, -5) is None
    assert saved(b, seq, 60) is None  # b's heartbeats said no step
    assert saved(a, seq, 60) == 60  # the next one: the slow pod leaves
    assert saved(a, seq, 80) is None  # once
    assert safe.declined(job.status, b, "no requests", 0.0) is None  # a late decline: no new wait
    assert saved(a, seq, 90) is None
    actions = job.feed(ev.CheckpointCommitted(60))
    assert job.status.slow_count == 0 and any(type(a).__name__ == "EvictPod" for a in actions)


def test_without_a_slow_pod_a_scripts_saves_commit_nothing() -> None:
    job, safe = Driver(), SafePoints("job")
    job.to_running()
    a = job.pods[0]
    safe.step_seen(job.status, a, job.status.seq, 100, 1.0)
    assert safe.declined(job.status, a, "no requests", 0.0) is None
    assert safe.script_saved(job.status, a, job.status.seq, 60, 0.0) is None


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_node_with_a_degraded_link_is_found_and_left_at_the_scripts_own_save(
    tmp_path: Path,
) -> None:
    """node-1's link throttled to 100 Mbit/s (each step moves 2.2 MB of gradients) while a
    plain DDP script trains: the job slows to about a third; the pace watch reports it,
    allreduce_perf names node-1, and its pod moves to the spare right after the script's next
    ``torch.save``; the job ends with no fault counted."""
    command = [sys.executable, str(PLAIN_DDP), "--steps", "900", "--step-time-s", "0.05",
               "--hidden", "16384", "--ckpt-dir", str(tmp_path / "ckpt")]  # fmt: skip
    run = await run_with_a_degraded_link(tmp_path, "nic", "100mbit", command)
    assert "script saved at step" in run.output, run.output


async def _drain_at_the_next_own_save(tmp_path: Path, *script_args: str) -> ClusterRun:
    """``aegis ctl drain node-1`` at step 130 of a plain DDP script that saves every 60 steps
    and takes no checkpoint requests: the run's pod moves to the spare at a save of the
    script's after the drain, and every rank resumes from it (no DrainForced, nothing
    counted)."""
    ckpt = tmp_path / "ckpt"
    command = [sys.executable, str(PLAIN_DDP), "--steps", "400", "--step-time-s", "0.05",
               "--ckpt-every", "60", "--ckpt-dir", str(ckpt), *script_args]  # fmt: skip
    drained: list[str] = []

    async def drain(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        drained.append(await drain_at_step(log_dir, "dr", 130, 120))  # after two own saves

    flags = ["--nodes", "3", "--spare-nodes", "1", "--job", "dr", "--max-retry", "2"]
    run = await run_cluster(tmp_path, flags, command, during=drain, timeout_s=560)
    assert drained and drained[0].startswith("0: "), drained
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, run.story()
    assert status["error_nodes"] == [] and run.pods["dr-1"]["node"] == "spare-0", status
    events = run.events()
    assert not any(e["type"] == "DrainForced" for e in events), events
    [committed] = [e for e in events if e["type"] == "CheckpointCommitted"]
    assert committed["step"] % 60 == 0 and committed["step"] > 120, committed
    assert "script saved at step" in run.output, run.output
    said = (run.log_dir / "pods" / "dr-1.log").read_text()
    resumed = [int(n) for n in re.findall(r"rank=1 resumed from step (\d+)", said)]
    # from that save, or the script's next one if it saved again before it was stopped
    assert resumed and resumed[0] in (committed["step"], committed["step"] + 60), said[-3000:]
    assert leftovers(run.log_dir) == []
    return run


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(600)
async def test_a_drain_waits_for_the_scripts_next_own_save_and_resumes_from_it(
    tmp_path: Path,
) -> None:
    """The script's cadence puts its next save well before the drain's deadline: the drain
    waits for it (see ``_drain_at_the_next_own_save``)."""
    await _drain_at_the_next_own_save(tmp_path)


@pytest.mark.slow
@pytest.mark.timing
@pytest.mark.timeout(600)
async def test_a_drain_waits_through_an_evaluation_pause_for_the_scripts_save(
    tmp_path: Path,
) -> None:
    """The script stops training for 20 s at step 140 (an evaluation), right after the drain:
    its save at step 180 is late by the clock (due about 5 s after the one at 120), but
    training has not gone the cadence's steps past 120, and at its pace it comes well before
    the deadline, so the drain waits on and the pod leaves at that save, instead of resuming
    every rank from step 120."""
    run = await _drain_at_the_next_own_save(tmp_path, "--pause-at-step", "140", "--pause-s", "20")
    said = (run.log_dir / "pods" / "dr-0.log").read_text()
    assert "rank=0 pausing at step 140" in said, said[-3000:]
    assert "the drain waits on for it" in run.output, run.output  # late by the clock
