"""The emulated cluster for end-to-end tests: ``aegis run --isolate-nodes`` as a user runs it.

Every node has its own network namespace (an address on the run's bridge, 198.18.0.0/24 inside
the run's own namespace), a private ``/dev/shm`` and its own hostname; see
``aegis.platforms.emulated``. A test runs the real command line, may play a scenario while it
runs (``during``: an ``aegis ctl`` from the host, a kill), and reads what the run left: its exit
status, the ``--status-file``, the log directory and the probe's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from aegis.adapters import netns
from aegis.platforms import emulated
from tests.jsonl import json_lines
from tests.waits import async_wait_until

AEGIS = [sys.executable, "-m", "aegis.cli.main"]
PROBE = Path(__file__).parent / "bin" / "cluster_probe.py"
TRAIN = Path(__file__).parent.parent / "examples" / "train_ddp.py"
PLAIN_DDP = Path(__file__).parent / "bin" / "plain_ddp.py"  # never imports aegis


def address_of(index: int) -> str:
    """The bridge address of the index-th node of a run (nodes first, then spares)."""
    return f"{emulated.SUBNET}.{emulated.FIRST_NODE + index}"


def require_namespaces() -> None:
    problem = netns.missing_prerequisite()
    if problem is not None:
        pytest.skip(f"the emulated cluster {problem}")


@dataclass(slots=True)
class ClusterRun:
    rc: int
    output: str
    log_dir: Path
    status: dict[str, Any]
    out: Path  # the probe's records

    @property
    def pods(self) -> dict[str, dict[str, Any]]:
        return dict(self.status["status"]["pod_infos"])

    def records(self, rank: int) -> list[dict[str, Any]]:
        return json_lines(self.out / f"rank-{rank}.jsonl")

    def events(self) -> list[dict[str, Any]]:
        return json_lines(self.log_dir / "events.jsonl")

    def story(self) -> str:
        """What the run's phase log reported and decided, a line each: an assertion's message
        that says why a run went another way (its output may be long, its events terse)."""
        lines = json_lines(self.log_dir / "faults.jsonl")
        told = [f"{e['phase']} {e['pod'] or '-'}: {e['message'][:300]}" for e in lines
                if e.get("kind") in ("report", "decision")]  # fmt: skip
        return "\n".join(told)


Scenario = Callable[[asyncio.subprocess.Process, Path], Awaitable[None]]


async def run_cluster(  # noqa: PLR0913 (keyword-only: each a way a test run differs)
    tmp_path: Path,
    run_args: Sequence[str],
    command: Sequence[str],
    *,
    during: Scenario | None = None,
    timeout_s: float = 240.0,
    cwd: Path | None = None,
    aegis: Sequence[str] = AEGIS,
    own_group: bool = False,
    env: Mapping[str, str] | None = None,
) -> ClusterRun:
    """``aegis run --isolate-nodes RUN_ARGS -- COMMAND`` started in ``cwd``, to its end
    (``during`` meanwhile); ``aegis``: how to run it (another environment's python);
    ``own_group``: in a session of its own, its process group the one a terminal signals;
    ``env``: added to this environment (the run's agents and training inherit it)."""
    require_namespaces()
    log_dir, status_file, out = tmp_path / "logs", tmp_path / "status.json", tmp_path / "out"
    out.mkdir(exist_ok=True)
    argv = [*aegis, "run", "--isolate-nodes", "--view", "plain", "--log-dir", str(log_dir),
            "--status-file", str(status_file), *run_args, "--", *command]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL, cwd=cwd, start_new_session=own_group,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    assert proc.stdout is not None
    reading = asyncio.ensure_future(proc.stdout.read())
    try:
        async with asyncio.timeout(timeout_s):
            if during is not None:
                await during(proc, log_dir)
            output = (await reading).decode(errors="replace")
            rc = await proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert status_file.exists(), output
    status = json.loads(status_file.read_text())
    return ClusterRun(rc, output, log_dir, status, out)


def leftovers(log_dir: Path) -> list[str]:
    """Processes of a run still alive (agents, training, node holders name the log dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            if str(log_dir) in cmdline:
                found.append(f"{proc.pid}: {cmdline[:200]}")
    return found


def agent_of(log_dir: Path, pod: str) -> int | None:
    """The pid of ``pod``'s agent (``python -m aegis agent ... --pod POD``) in this run."""
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or []
            joined = " ".join(cmdline)
            if "aegis agent" in joined and f"--pod {pod} " in joined and str(log_dir) in joined:
                return int(proc.pid)
    return None


async def ctl(*args: str) -> str:
    """``aegis ctl ARGS`` run on the host: ``"<exit status>: <what it said>"``."""
    proc = await asyncio.create_subprocess_exec(
        *AEGIS, "ctl", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    said, _ = await proc.communicate()
    return f"{proc.returncode}: {said.decode()}"


async def drain_at_step(log_dir: Path, job: str, step: int, deadline_s: float) -> str:
    """Once rank 1 (``<job>-1``, on node-1) has logged ``step``: ``aegis ctl drain node-1``."""
    pod_log = log_dir / "pods" / f"{job}-1.log"
    await async_wait_until(lambda: last_step(pod_log, 1) >= step, 300, f"rank 1 at step {step}")
    return await ctl("drain", "node-1", "--deadline-s", f"{deadline_s:g}", "--log-dir",
                     str(log_dir))  # fmt: skip


def master_pid(log_dir: Path, index: int) -> int:
    """The pid of the run's master ``index`` (``--masters N``)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if f"master-{index}" in cmdline and str(log_dir) in cmdline:
            return int(proc.pid)
    raise AssertionError(f"no master-{index} process")


def holder_of(log_dir: Path, node: str) -> int:
    """The pid of ``node``'s holder (``aegis-node NODE HOSTS``, its hosts file in the run)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith(f"aegis-node {node} ") and str(log_dir) in cmdline:
            return int(proc.pid)
    raise AssertionError(f"no holder of {node}")


def in_net_namespace_of(pid: int) -> list[int]:
    """Every process in the network namespace of ``pid`` (itself included)."""
    ns = os.readlink(f"/proc/{pid}/ns/net")
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/net") == ns:
                    found.append(int(entry.name))
    return found


async def throttle(log_dir: Path, node: str, rate: str) -> None:
    """Limit ``node``'s egress to ``rate`` (``tc ... tbf``, e.g. ``100mbit``): a degraded NIC."""
    net = f"--net=/proc/{holder_of(log_dir, node)}/ns/net"
    tc = ["nsenter", net, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
          "burst", "64kbit", "latency", "1s"]  # fmt: skip
    done = await asyncio.create_subprocess_exec(*tc)
    assert await done.wait() == 0, tc


async def run_with_a_degraded_link(
    tmp_path: Path, job: str, rate: str, command: Sequence[str]
) -> ClusterRun:
    """``command`` on three nodes and a spare; node-1's egress is throttled to ``rate`` once
    rank 1 has logged step 150. Checks what every such run shows: the job ended well with no
    fault counted, the pace watch reported the slowdown, a checkpoint was committed (the
    script's own save) and then ``<job>-1`` moved to the spare; nothing was left behind."""
    throttled: list[str] = []

    async def degrade(proc: asyncio.subprocess.Process, log_dir: Path) -> None:
        pod_log = log_dir / "pods" / f"{job}-1.log"
        await async_wait_until(lambda: last_step(pod_log, 1) >= 150, 200, "node-1 training")
        await throttle(log_dir, "node-1", rate)
        throttled.append("node-1")

    flags = ["--nodes", "3", "--spare-nodes", "1", "--job", job, "--max-retry", "2",
             "--pace-window-s", "5", "--pace-drop", "0.5"]  # fmt: skip
    run = await run_cluster(tmp_path, flags, command, during=degrade, timeout_s=560)
    assert throttled == ["node-1"]
    assert run.rc == 0, run.output
    status = run.status["status"]
    assert status["phase"] == "Succeed" and status["recover_count"] == 0, status
    assert run.pods[f"{job}-1"]["node"] == "spare-0", status
    kinds = ("SlowdownReported", "CheckpointCommitted", "PodRestarted")
    said = [(e["type"], e.get("pod")) for e in run.events() if e["type"] in kinds]
    assert said[:3] == [("SlowdownReported", None), ("CheckpointCommitted", None),
                        ("PodRestarted", f"{job}-1")], said  # fmt: skip
    assert leftovers(run.log_dir) == []
    return run


def plain_ddp(ckpt: Path, steps: int, step_time_s: float = 0.05) -> list[str]:
    """The plain DDP script as a run's command (every rank logs ``rank=R step N`` each step)."""
    return [sys.executable, str(PLAIN_DDP), "--steps", str(steps), "--step-time-s",
            str(step_time_s), "--ckpt-dir", str(ckpt)]  # fmt: skip


def last_step(pod_log: Path, rank: int) -> int:
    """The last step ``rank`` logged in its pod's log (``plain_ddp``'s lines), -1 before any."""
    if not pod_log.exists():
        return -1
    lines = [line for line in pod_log.read_text().splitlines() if f" rank={rank} step " in line]
    return max((int(line.split(" step ")[1].split()[0]) for line in lines), default=-1)


def probe(out: Path, ckpt: str, *extra: str) -> list[str]:
    """The probe; ``ckpt``: the run's checkpoints (``aegis run`` keeps them in LOG/checkpoints)."""
    return [sys.executable, str(PROBE), str(out), str(ckpt), *extra]


def assert_each_node_kept_to_itself(run: ClusterRun, ranks: int) -> None:
    """Each rank ran on its pod's node under that node's name and address, and its node's
    ``/dev/shm`` held nothing of another pod's (no rank could read another node's memory)."""
    job = run.status["spec"]["job"]
    pods = [f"{job}-{r}" for r in range(ranks)]
    for rank in range(ranks):
        for record in run.records(rank):
            others = [p for p in pods if p != record["pod"]]
            assert record["address"].startswith(f"{emulated.SUBNET}."), record
            assert record["hostname"].startswith(("node-", "spare-")), record
            assert not [f for f in record["shm"] for p in others if f"-{p}-" in f], record
