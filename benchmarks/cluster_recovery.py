"""Recovery on the emulated cluster (``aegis run --isolate-nodes``) beside the shared host.

Usage: python benchmarks/cluster_recovery.py [--ranks 4] [--crash-at-step 400] [--steps 420]
[--repeats 1]

Two recoveries of a ``--ranks``-rank gloo job (``examples/train_ddp.py``, Aegis checkpoints),
each run on one shared host and on the emulated cluster (every node its own network namespace,
``/dev/shm`` and hostname), side by side in the same script:
- warm in place: rank 1 raises at ``--crash-at-step`` (a software fault: every rank restarted
  in place from its agent's zygote, the checkpoint from the node's shared memory);
- node replacement: rank 0 exits with no traceback and node-0's GPU check is broken (injected):
  the checks run, rank 0's pod moves to spare-0 (a fresh node: its checkpoint from disk) and the
  rendezvous follows it.
Recovery = from the fault's line to the moment every rank has logged a step of the next
incarnation (``benchmarks/recovery.py``'s measure). Each isolated figure is printed with its
ratio to the shared host's of the same repeat.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import TRAIN, parse, phases, recovery_s

SCENARIOS = {
    "warm in place": (["--crash-rank", "1"], "--crash-at-step", []),
    "node replacement": (["--exit-rank", "0"], "--exit-at-step", ["--inject-fault", "node-0:gpu"]),
}


def run(
    work: Path, name: str, isolated: bool, args: argparse.Namespace, repeat: int
) -> float | None:
    fault, at, extra = SCENARIOS[name]
    tag = f"{name.replace(' ', '-')}-{'iso' if isolated else 'shared'}-{repeat}"
    logs, ckpt = work / f"{tag}-logs", work / f"{tag}-ckpt"
    command = [sys.executable, str(TRAIN), "--steps", str(args.steps), "--ckpt-every", "5",
               "--ckpt-dir", str(ckpt), at, str(args.crash_at_step), *fault,
               "--step-time-s", "0.02"]  # fmt: skip
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--nodes", str(args.ranks),
            "--spare-nodes", "1", "--max-retry", "3", "--job", "bench", "--view", "plain",
            "--log-dir", str(logs), *extra, *(["--isolate-nodes"] if isolated else []),
            "--", *command]  # fmt: skip
    env = {**os.environ, "AEGIS_LOG_LEVEL": "INFO"}  # the agents' order lines, for the split
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, env=env)
    if done.returncode != 0:
        print(f"  {tag}: exit {done.returncode}: {done.stdout[-300:]}", file=sys.stderr)
        return None
    text = "\n".join(p.read_text() for p in (logs / "pods").glob("*.log"))
    lines = sorted(parse(text))
    split = phases(logs, lines)
    if split is not None:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in split.items() if not k.startswith("check"))
        print(f"  {tag}: {parts}")
    return recovery_s(lines, args.ranks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--crash-at-step", type=int, default=400)
    parser.add_argument("--steps", type=int, default=420)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aegis-bench-cluster-"))
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, {args.ranks} ranks, "
          f"{datetime.datetime.now():%Y-%m-%d %H:%M}")  # fmt: skip
    for name in SCENARIOS:
        ratios = []
        for repeat in range(args.repeats):
            shared = run(work, name, False, args, repeat)
            isolated = run(work, name, True, args, repeat)
            ratio = isolated / shared if shared and isolated else None
            if ratio is not None:
                ratios.append(ratio)
            print(f"{name} #{repeat}: shared host {_s(shared)}, isolated {_s(isolated)}"
                  f" ({f'{ratio:.2f}x' if ratio else '-'})")  # fmt: skip
        if ratios:
            print(f"{name}: isolated / shared median {statistics.median(ratios):.2f}x")
    print(f"work: {work}")


def _s(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "failed"


if __name__ == "__main__":
    main()
