"""Work lost to a GPU that fails: with the agents' health watch vs without, side by side.

Usage: python benchmarks/health_drain.py [--trials 2] [--steps 500] [--warning-s 10] [--seed 1]
[--sign readings|xid] [--keep]

Each trial runs the same job twice on the emulated cluster (``aegis run --isolate-nodes
--nodes 2 --spare-nodes 1``; ``tests/bin/plain_ddp.py``, a script that never imports aegis,
``torch.save`` every 20 steps of 0.05 s), once with ``--health-s 1`` and once with
``--health-s 0``. The agents read their GPUs through the real NVML reader, answered by
``tests/bin/nvml/pynvml.py`` from recordings of real GPUs. At a random step node-1's GPUs start
to show warning signs (``--sign readings``, the V100 recording: a double-bit ECC page pending
retirement, a GPU at its slowdown temperature; ``--sign xid``: GPU 0 has an Xid 79 event between
two looks, heard only by the agent's Xid listener); ``--warning-s`` later the GPU fails and
takes the node with it: every process in node-1's namespaces is SIGKILLed (a node lost).
Reported per mode: the steps done twice (a rank's step lines minus its distinct steps, the worst
rank), the faults counted (``recover_count``), and the run's wall time. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.cluster import holder_of, in_net_namespace_of, last_step, plain_ddp  # noqa: E402

FAILING = ROOT / "tests" / "data" / "nvml_v100_retired_pending.json"
NVML = ROOT / "tests" / "bin" / "nvml"
STEP = re.compile(r" rank=(\d+) step (\d+) ")


async def until(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"health_drain benchmark: timed out waiting for {what}")
        await asyncio.sleep(0.2)


def redone(log_dir: Path) -> int:
    """Steps done twice, the worst rank (every pod log's step lines)."""
    counts: dict[int, Counter[int]] = {}
    for path in (log_dir / "pods").glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if found := STEP.search(line):
                counts.setdefault(int(found[1]), Counter())[int(found[2])] += 1
    return max((sum(c.values()) - len(c) for c in counts.values()), default=0)


def _cmdline(pid: int) -> str:
    try:
        return f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid} (gone)"


Row = tuple[int, int, float]  # steps redone, faults counted, seconds of the run


async def one_run(health_s: float, fail_at: int, args: argparse.Namespace) -> Row:
    tmp = Path(tempfile.mkdtemp(prefix=f"aegis-health-{health_s:g}-"))
    gpus, log_dir, status_file = tmp / "gpus", tmp / "logs", tmp / "status.json"
    gpus.mkdir()
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--isolate-nodes", "--view", "plain",
            "--log-dir", str(log_dir), "--status-file", str(status_file), "--nodes", "2",
            "--spare-nodes", "1", "--job", "h", "--health-s", f"{health_s:g}", "--",
            *plain_ddp(tmp / "ckpt", steps=args.steps)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(NVML), "AEGIS_TEST_NVML": str(gpus)}
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)  # fmt: skip
    pod_log = log_dir / "pods" / "h-1.log"
    await until(lambda: last_step(pod_log, 1) >= fail_at, 300, f"step {fail_at}")
    if args.sign == "xid":
        (gpus / "node-1.xids").write_text("0 79\n")  # an event at the agent's next look
    else:
        shutil.copy(FAILING, gpus / "node-1.tmp")  # the warning signs (never read half written)
        (gpus / "node-1.tmp").rename(gpus / "node-1.json")
    warned = time.time()
    await asyncio.sleep(args.warning_s)  # (the benchmark's clock: the GPU fails this much later)
    victims = in_net_namespace_of(holder_of(log_dir, "node-1"))  # the GPU takes the node
    if args.keep:
        said = [_cmdline(pid) for pid in victims]
        (tmp / "killed.txt").write_text("\n".join(said) + "\n")
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await asyncio.wait_for(proc.wait(), 600)
    seconds = time.monotonic() - started
    status = json.loads(status_file.read_text())["status"]
    if status["phase"] != "Succeed":
        raise SystemExit(f"health_drain benchmark: the job ended {status['phase']} ({tmp})")
    lost = redone(log_dir)
    if args.keep:
        print(f"  (kept: {tmp}; warnings at {warned:.2f}, the node killed {args.warning_s:g} s "
              "later)", flush=True)  # fmt: skip
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return lost, int(status["recover_count"]), seconds


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--warning-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--sign",
        choices=("readings", "xid"),
        default="readings",
        help="the warning sign: the GPUs' readings, or an Xid event between looks",
    )
    p.add_argument("--keep", action="store_true", help="keep each run's directory (logs)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    points = [rng.randint(60, 120) for _ in range(args.trials)]
    now = datetime.datetime.now(datetime.UTC)
    print(f"# health drain benchmark, {now:%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.steps} steps of "
          f"0.05 s, torch.save every 20; {args.sign} warnings at steps {points}, the GPU fails "
          f"{args.warning_s:g} s later")  # fmt: skip
    results: dict[str, list[Row]] = {"watch (1 s)": [], "no watch": []}
    for at in points:
        for mode, rows in results.items():
            row = await one_run(1.0 if mode.startswith("watch") else 0.0, at, args)
            rows.append(row)
            print(f"{mode:12s} warnings at step {at:3d}: {row[0]:3d} steps redone, "
                  f"{row[1]} fault(s) counted, {row[2]:5.1f} s", flush=True)  # fmt: skip
    print("\n| mode | steps redone (mean, each) | faults counted | run (mean s) |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        each = ", ".join(str(r[0]) for r in rows)
        mean_redone = statistics.mean(r[0] for r in rows)
        mean_s = statistics.mean(r[2] for r in rows)
        print(f"| {mode} | {mean_redone:.1f} ({each}) | {sum(r[1] for r in rows)} | "
              f"{mean_s:.1f} |")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
