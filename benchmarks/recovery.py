"""Recovery time of one crashed rank in a 4-rank gloo job, side by side in one run.

Usage: python benchmarks/recovery.py [--ranks 4] [--crash-at-step 12] [--steps 25] [--savers]
[--baseline-src DIR] [--aegis-only]
(``--crash-at-step 400 --steps 420``: a crash in steady state, after the zygotes are ready;
``--baseline-src DIR``: also aegis warm with the agents importing ``aegis`` from DIR, e.g. the
``src`` of an older checkout, side by side; ``--aegis-only``: no torchrun and relaunch runs)

Four ways to recover, plus the floor:
- aegis warm: ``aegis run`` (restart in place of every rank from the agents' zygotes, issue 9);
  the crash is an uncaught exception (a software fault: no troubleshooting round), and once more
  an exit with no traceback (``--exit-at-step``: the master runs the checks first); both also
  with ``tests/bin/plain_ddp.py``, the same job as a script that never imports aegis (its steps
  and its dying report come from the agent's ``sitecustomize``, issue 18);
  ``--no-optimizer-crash-at-step S``: the plain script with no optimizer at all (``all_reduce``
  by hand: no step signal, so its next zygote is made 60 s after a start; S must come later);
- aegis cold: the same with ``AEGIS_PREWARM=0`` in the environment of ``aegis run`` (the agents it
  starts inherit it): every restart a fresh interpreter;
- torchrun: ``torchrun --standalone --nproc-per-node N --max-restarts 3`` (its own restart);
- relaunch: the coarse fallback: the whole launch fails, is run again, resumes from the checkpoint;
- floor:    a fresh start of the same job to its first step.

Recovery = from the crash line of the killed rank to the moment every rank has logged a step of
the next incarnation. Each figure is printed with its ratio to the floor measured in this run.
For Aegis the recovery is split (agent logs at INFO, ``events.jsonl``): detection (crash to the
master's Error event: the crashed process's exit and the report), the troubleshoot round (Error to
the restart order: the checks) and the restart proper (order to every rank's next step); the
troubleshoot round's checks are listed with their durations (the slowest pod's, from the pods'
answers in ``events.jsonl``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aegis.platforms import local_run

TRAIN = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
# the same job written as a new user would: no aegis import, no aegis.progress (issue 18)
PLAIN = Path(__file__).resolve().parent.parent / "tests" / "bin" / "plain_ddp.py"
LINE = re.compile(r"^(\S+) rank=(\d+) (.*)$")


def parse(text: str) -> list[tuple[float, int, str]]:
    out = []
    for line in text.splitlines():
        match = LINE.match(line.strip())
        if match:
            ts = datetime.datetime.fromisoformat(match.group(1)).timestamp()
            out.append((ts, int(match.group(2)), match.group(3)))
    return out


def recovery_s(lines: list[tuple[float, int, str]], ranks: int) -> float | None:
    crash = [ts for ts, _, msg in lines if msg.startswith("crashing")]
    if not crash:
        return None
    after = [(ts, rank) for ts, rank, msg in lines if ts > crash[0] and msg.startswith("step ")]
    first: dict[int, float] = {}
    resumed = {r for ts, r, msg in lines if ts > crash[0] and "resumed from" in msg}
    for ts, rank in after:
        if rank in resumed and rank not in first:
            first[rank] = ts
    if len(first) < ranks:
        return None
    return max(first.values()) - crash[0]


def train_args(
    ckpt: Path,
    crash_at: int,
    steps: int,
    crash_mode: str = "raise",
    script: Path = TRAIN,
    extra: tuple[str, ...] = (),
) -> list[str]:
    return [
        str(script),
        *extra,
        "--steps",
        str(steps),
        "--ckpt-every",
        "5",
        "--ckpt-dir",
        str(ckpt),
        "--exit-at-step" if crash_mode == "exit" else "--crash-at-step",
        str(crash_at),
        "--exit-rank" if crash_mode == "exit" else "--crash-rank",
        "1",
        "--step-time-s",
        "0.02",
    ]


def floor_s(ranks: int, work: Path) -> float:
    """A fresh start to the first step of every rank."""
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            *train_args(work / "floor", -1, 1),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    firsts: dict[int, float] = {}
    for ts, rank, msg in parse(proc.stdout):
        if msg.startswith("step ") and rank not in firsts:
            firsts[rank] = ts
    return max(firsts.values()) - started


AGENT_LINE = re.compile(r"^aegis agent: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


def agent_lines(text: str) -> list[tuple[float, str]]:
    out = []
    for line in text.splitlines():
        match = AGENT_LINE.match(line.strip())
        if match:
            when = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append((when.timestamp(), match.group(2)))
    return out


def phases(logs: Path, lines: list[tuple[float, int, str]]) -> dict[str, float] | None:
    """Detection, troubleshoot round and restart proper of an Aegis recovery, in seconds."""
    crash = [ts for ts, _, msg in lines if msg.startswith("crashing")]
    events = [json.loads(x) for x in (logs / "events.jsonl").read_text().splitlines() if x]
    errors = [e["ts"] for e in events if e.get("type") == "Error"]
    text = "\n".join(p.read_text() for p in (logs / "pods").glob("*.log"))
    orders = [ts for ts, msg in agent_lines(text) if msg.startswith("order restart")]
    starts = [
        msg for _, msg in agent_lines(text) if msg.startswith("started") and "restart 1" in msg
    ]
    steps = [ts for ts, _, msg in lines if crash and ts > crash[0] and msg.startswith("step ")]
    if not (crash and errors and orders and steps):
        return None
    first_steps: dict[int, float] = {}
    for ts, rank, msg in lines:
        if ts > min(orders) and msg.startswith("step ") and rank not in first_steps:
            first_steps[rank] = ts
    checks: dict[str, float] = {}
    for event in events:
        if event.get("type") == "Finish" and event.get("phase") == "Troubleshooting":
            for result in event.get("data", {}).get("response", {}).get("results", ()):
                name = str(result["check_type"])
                checks[name] = max(checks.get(name, 0.0), float(result["duration_s"]))
    return {
        **{f"check {name}": value for name, value in checks.items()},
        "detect": errors[0] - crash[0],
        "troubleshoot": min(orders) - errors[0],
        "restart": max(first_steps.values()) - min(orders),
        "warm_starts": float(sum("warm)" in msg for msg in starts)),
    }


def start_savers(ranks: int, logs: Path) -> list[subprocess.Popen[bytes]]:
    """Stop-gap: one checkpoint saver daemon per pod, where the agent's link tells training to
    look (``linked._saver_settings``); the agent does not start it itself yet."""
    savers = []
    for rank in range(ranks):
        pod, node = f"bench-{rank}", f"node-{rank}"
        shm = Path("/dev/shm") / f"aegis-bench-{pod}-{node}"
        argv = [sys.executable, "-m", "aegis.checkpoint.daemon", "--shm-dir", str(shm),
                "--ckpt-dir", str(logs / "checkpoints" / pod)]  # fmt: skip
        savers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
    return savers


def run_aegis(  # noqa: PLR0913 (one keyword per benchmark option)
    ranks: int,
    work: Path,
    crash_at: int,
    steps: int,
    *,
    prewarm: str,
    savers: bool,
    pythonpath: str | None = None,
    crash_mode: str = "raise",
    script: Path = TRAIN,
    extra: tuple[str, ...] = (),
) -> tuple[float | None, dict[str, float] | None]:
    name = f"aegis-{prewarm}-{crash_mode}-{script.stem}{len(extra)}" + (
        "-baseline" if pythonpath else ""
    )
    daemons = start_savers(ranks, work / f"{name}-logs") if savers else []
    settings = local_run.RunSettings(
        command=(
            sys.executable,
            *train_args(work / name, crash_at, steps, crash_mode, script, extra),
        ),
        nodes=ranks,
        spare_nodes=0,
        max_retry=3,
        job="bench",
        log_dir=work / f"{name}-logs",
    )
    saved = {key: os.environ.get(key) for key in ("AEGIS_PREWARM", "AEGIS_LOG_LEVEL", "PYTHONPATH")}
    os.environ.update(AEGIS_PREWARM=prewarm, AEGIS_LOG_LEVEL="INFO")  # inherited by the agents
    if pythonpath:  # the agents import aegis from there
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (pythonpath, saved["PYTHONPATH"]) if p
        )
    try:
        result = asyncio.run(local_run.run_local(settings))
    finally:
        for daemon in daemons:
            daemon.terminate()
            daemon.wait(timeout=30)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    logs = work / f"{name}-logs"
    text = "\n".join(p.read_text() for p in (logs / "pods").glob("*.log"))
    lines = sorted(parse(text))
    if result.exit_code != 0:
        return None, None
    return recovery_s(lines, ranks), phases(logs, lines)


def run_torchrun(
    ranks: int, work: Path, crash_at: int, steps: int, timeout_s: float
) -> float | None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=3",
        *train_args(work / "tr", crash_at, steps),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return recovery_s(parse(out), ranks)
    return recovery_s(parse(proc.stdout), ranks) if proc.returncode == 0 else None


def run_relaunch(ranks: int, work: Path, crash_at: int, steps: int) -> float | None:
    """The whole launch fails with the crash and is simply run again (the crash marker in the
    checkpoint directory keeps the second launch from crashing)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        *train_args(work / "re", crash_at, steps),
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if second.returncode != 0:
        return None
    return recovery_s(sorted(parse(first.stdout) + parse(second.stdout)), ranks)


Splits = dict[str, dict[str, float] | None]


def aegis_runs(args: argparse.Namespace, work: Path) -> tuple[dict[str, float | None], Splits]:
    """Every ``aegis run`` recovery: (seconds by name, their splits by name)."""
    crash, steps = args.crash_at_step, args.steps
    warm, warm_phases = run_aegis(
        args.ranks, work, crash, steps, prewarm="auto", savers=args.savers
    )
    cold, cold_phases = run_aegis(args.ranks, work, crash, steps, prewarm="0", savers=args.savers)
    checked, checked_phases = run_aegis(
        args.ranks, work, crash, steps, prewarm="auto", savers=args.savers, crash_mode="exit"
    )
    splits: Splits = {
        "aegis warm": warm_phases,
        "aegis cold": cold_phases,
        "aegis warm, exit without a traceback": checked_phases,
    }
    results: dict[str, float | None] = {
        "aegis warm": warm,
        "aegis cold (AEGIS_PREWARM=0)": cold,
        "aegis warm, exit without a traceback (checks run)": checked,
    }
    for mode, label in (("raise", ""), ("exit", ", exit without a traceback (checks run)")):
        name = f"aegis warm, plain script (no aegis import){label}"
        results[name], splits[name] = run_aegis(
            args.ranks, work, crash, steps, prewarm="auto", savers=args.savers,
            crash_mode=mode, script=PLAIN,
        )  # fmt: skip
    if args.no_optimizer_crash_at_step:  # no step signal: its zygote is made 60 s after a start
        at = args.no_optimizer_crash_at_step
        for mode, label in (("raise", ""), ("exit", ", exit without a traceback (checks run)")):
            name = f"aegis warm, plain script with no optimizer (all_reduce by hand){label}"
            results[name], splits[name] = run_aegis(
                args.ranks, work, at, at + 20, prewarm="auto", savers=args.savers,
                crash_mode=mode, script=PLAIN, extra=("--no-optimizer",),
            )  # fmt: skip
    if args.baseline_src:
        base, base_phases = run_aegis(
            args.ranks, work, crash, steps, prewarm="auto", savers=args.savers,
            pythonpath=str(Path(args.baseline_src).resolve()),
        )  # fmt: skip
        results["aegis warm, baseline agents"] = base
        splits["aegis warm, baseline agents"] = base_phases
    return results, splits


def print_results(results: dict[str, float | None], splits: Splits, floor: float) -> None:
    for name, value in results.items():
        if value is None:
            print(f"{name}: never recovered")
        else:
            print(
                f"{name}: {value:.2f} s from the crash to every rank's next step "
                f"({value / floor:.2f}x floor)"
            )
    for name, split in splits.items():
        if split is not None:
            print(
                f"{name} split: detection {split['detect']:.2f} s, troubleshoot round "
                f"{split['troubleshoot']:.2f} s, restart order to every rank's step "
                f"{split['restart']:.2f} s ({split['restart'] / floor:.2f}x floor; "
                f"{split['warm_starts']:.0f} warm starts)"
            )
            checks = ", ".join(
                f"{key.removeprefix('check ')} {value:.2f}"
                for key, value in split.items()
                if key.startswith("check ")
            )
            print(f"{name} troubleshoot checks (slowest pod, s): {checks}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--crash-at-step", type=int, default=12)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--timeout-s", type=float, default=120)
    parser.add_argument(
        "--savers", action="store_true", help="start the saver daemons here (old agents only)"
    )
    parser.add_argument("--baseline-src", help="also run aegis warm with agents from this src")
    parser.add_argument("--aegis-only", action="store_true", help="no torchrun/relaunch runs")
    parser.add_argument(
        "--no-optimizer-crash-at-step",
        type=int,
        default=0,
        help="also the plain script with no optimizer, crashing at this step (past 60 s)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aegis-bench-recovery-"))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
        f"{platform.python_version()}, {args.ranks} ranks, {datetime.datetime.now():%Y-%m-%d %H:%M}"
    )
    try:
        floor = floor_s(args.ranks, work)
        print(f"floor (fresh start to first step): {floor:.2f} s")
        results, splits = aegis_runs(args, work)
        crash, steps = args.crash_at_step, args.steps
        if not args.aegis_only:
            results["torchrun --max-restarts 3"] = run_torchrun(
                args.ranks, work, crash, steps, args.timeout_s
            )
            results["coarse relaunch"] = run_relaunch(args.ranks, work, crash, steps)
        print_results(results, splits, floor)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
