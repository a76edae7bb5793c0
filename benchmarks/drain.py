"""Work lost by a planned drain: checkpoint on request vs periodic checkpoints only, side by side.

Usage: python benchmarks/drain.py [--trials 3] [--ckpt-every 20] [--steps 120] [--seed 1]

Each trial runs a real 2-rank gloo job of ``examples/train_ddp.py`` under ``aegis run``'s local
platform (real nats-server, agents, checkpoint savers) and drains the node of rank 1 at a random
training step (uniform over two checkpoint intervals, the same points for both modes) through
the same control path as ``aegis ctl drain``. Modes:
- request: the script calls ``aegis.checkpoint.save_if_requested`` every step (the default);
- periodic: ``--no-ckpt-requests``: the script only saves every ``--ckpt-every`` steps. The
  agent declines the request; once two saves have shown the script's cadence, the drain waits
  for the next one (due before the deadline), else it moves the pod at once and the job resumes
  from the last periodic checkpoint;
- plain: ``tests/bin/plain_ddp.py``, a script that never imports aegis and ``torch.save``s every
  ``--ckpt-every`` steps on rank 0 (its own saves, seen by the agent's start-up hook), the same
  rule as periodic.
Work lost = training steps done twice (a rank's step lines minus its distinct steps, the worst
rank), and the time from the drain to every rank's first step on the new placement.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aegis.core.phases import Phase
from aegis.master import control
from aegis.master.job_runner import JobRunner
from aegis.platforms import local_run
from aegis.platforms.local import LocalPlatform

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
PLAIN = Path(__file__).resolve().parent.parent / "tests" / "bin" / "plain_ddp.py"
STEP = re.compile(r"^(\S+) rank=(\d+) step (\d+) ")


async def one_run(mode: str, drain_at: int, args: argparse.Namespace) -> tuple[int, float]:
    """(steps redone, seconds from the drain to every rank's next step elsewhere)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"aegis-drain-{mode}-"))
    extra = ["--no-ckpt-requests"] if mode == "periodic" else []
    script = PLAIN if mode == "plain" else TRAIN
    settings = local_run.RunSettings(
        command=(sys.executable, str(script), "--steps", str(args.steps), "--step-time-s", "0.05",
                 "--ckpt-every", str(args.ckpt_every), "--ckpt-dir", str(tmp / "ckpt"), *extra),
        nodes=2, spare_nodes=1, max_retry=2, job=f"drain-{mode}", log_dir=tmp / "logs",
        grace_s=3.0, ckpt_dir=tmp / "ckpt",
    )  # fmt: skip
    seen: dict[str, object] = {}

    def observe(runner: JobRunner, platform: LocalPlatform) -> None:
        seen["runner"], seen["platform"] = runner, platform

    job = asyncio.create_task(local_run.run_local(settings, observe=observe))
    deadline = time.monotonic() + 300
    while "runner" not in seen or _step(seen["runner"]) < drain_at:  # type: ignore[arg-type]
        if job.done() or time.monotonic() > deadline:
            raise SystemExit(f"{mode}: the job never reached step {drain_at}")
        await asyncio.sleep(0.01)
    runner, plat = seen["runner"], seen["platform"]
    assert isinstance(runner, JobRunner) and isinstance(plat, LocalPlatform)
    drained_at = time.time()
    request = control.ControlRequest("drain", "-", nodes=["node-1"], reason="benchmark")
    reply = await control.handle(request, lambda ns, j: runner, lambda: [plat], lambda: [runner])
    assert reply.ok, reply.message
    result = await job
    assert result.status.phase is Phase.SUCCEED and result.status.recover_count == 0
    redone, back = 0, 0.0
    for rank in range(2):
        lines = (result.log_dir / "pods" / f"drain-{mode}-{rank}.log").read_text().splitlines()
        steps = [(m[1], int(m[3])) for line in lines if (m := STEP.match(line))]
        redone = max(redone, len(steps) - len({s for _, s in steps}))
        times = [t for t in (_ts(ts) for ts, _ in steps) if t > drained_at]
        back = max(back, _first_after_gap([drained_at, *times]) - drained_at)
    return redone, back


def _step(runner: JobRunner) -> int:
    return max((step for step, _ in runner.safe.steps.values()), default=-1)


def _ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def _first_after_gap(times: list[float]) -> float:
    """The first step after the pause of the move (the largest gap between two steps)."""
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    return max(gaps)[1]


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    points = [rng.randint(args.ckpt_every + 1, 3 * args.ckpt_every) for _ in range(args.trials)]
    now = datetime.datetime.now(datetime.UTC)
    print(f"# drain benchmark, {now:%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; checkpoint every "
          f"{args.ckpt_every} steps of 0.05 s; drains at steps {points}")  # fmt: skip
    results: dict[str, list[tuple[int, float]]] = {"request": [], "periodic": [], "plain": []}
    for at in points:
        for mode, rows in results.items():
            redone, back = await one_run(mode, at, args)
            rows.append((redone, back))
            print(f"{mode:9s} drain at step {at:3d}: {redone:3d} steps redone, "
                  f"training again {back:5.1f} s after the drain", flush=True)  # fmt: skip
    print("\n| mode | steps redone per drain (mean, each) | drain to training again (mean s) |")
    print("|---|---|---|")
    for mode, rows in results.items():
        lost = [r for r, _ in rows]
        each = ", ".join(str(r) for r in lost)
        print(f"| {mode} | {statistics.mean(lost):.1f} ({each}) | "
              f"{statistics.mean(b for _, b in rows):.1f} |")  # fmt: skip
    print(f"\nexpected without the API: about interval/2 = {args.ckpt_every / 2:g} steps")


if __name__ == "__main__":
    asyncio.run(main())
