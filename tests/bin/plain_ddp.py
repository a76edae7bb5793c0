"""A plain DDP job (gloo on CPU) that never imports aegis: what a new user brings.

Rank 0 saves ``ckpt-N.pt`` every ``--ckpt-every`` steps (atomically); every rank resumes from the
newest one. One log line per step, as ``examples/train_ddp.py`` writes them (the benchmark and
the tests read them). Chaos: ``--crash-at-step S --crash-rank R`` raises once in rank R at step S
(a marker in the checkpoint directory remembers the step), only once ``--crash-when FILE`` exists
if given (at the first step >= S that finds it); ``--exit-at-step S --exit-rank R`` exits 13 once
with no traceback; ``--stop-after-crash K`` ends the run K steps after the remembered crash.
``--hang-at-step S --hang-rank R`` sleeps forever in rank R at step S, once (a marker in the
checkpoint directory), while the other ranks wait for it in DDP's backward; with ``--hang-how
stop`` it stops itself with SIGSTOP instead (as a debugger, Ctrl-Z or a freezer would).
``--quiet``: only rank 0 logs its steps.
``--pause-at-step S --pause-s P``: every rank stops training for P seconds after step S, once (an
evaluation; a marker in the checkpoint directory).
``--crash-times N`` crashes in N incarnations (not once), the k-th at the step
S + k x ``--crash-step-shift``.
``--solo R:K[:GATE]`` (repeatable): after the last step and a barrier, rank R makes K more
optimizer steps on its own, once GATE exists if given.
``--no-optimizer``: no DDP and no ``torch.optim`` optimizer at all: a linear model fitted by hand,
its gradient summed with ``dist.all_reduce`` (a job with no step signal for Aegis to see).
``--hidden N``: the hidden layer's width (64: 9 KB of gradients a step; 16384: 2.2 MB, a job
whose pace a slow network link sets).
``--prepare-until FILE``: before training, rank 0 prepares its data (busy on the CPU and silent)
until FILE exists (at most 600 s), while the other ranks wait for it at a barrier, as scripts
that download or tokenize on one rank do.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", default="/tmp/plain-ddp-ckpt")
    p.add_argument("--step-time-s", type=float, default=0.01)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-when", default="")
    p.add_argument("--crash-times", type=int, default=1)
    p.add_argument("--crash-step-shift", type=int, default=0)
    p.add_argument("--exit-at-step", type=int, default=-1)
    p.add_argument("--exit-rank", type=int, default=1)
    p.add_argument("--stop-after-crash", type=int, default=-1)
    p.add_argument("--quiet", action="store_true", help="only rank 0 logs its steps")
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--hang-how", choices=("sleep", "stop"), default="sleep")
    p.add_argument("--pause-at-step", type=int, default=-1)
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--solo", action="append", default=[])
    p.add_argument("--no-optimizer", action="store_true", help="all_reduce by hand, no optimizer")
    p.add_argument("--hidden", type=int, default=64, help="the hidden layer's width (gradients)")
    p.add_argument("--prepare-until", default="", help="rank 0 busy until this file exists")
    return p.parse_args()


def log(rank: int, message: str) -> None:
    now = datetime.datetime.now().isoformat(timespec="milliseconds")
    print(f"{now} rank={rank} {message}", flush=True)


def resume(ckpt_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    found = sorted(ckpt_dir.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    if not found:
        return 0
    state = torch.load(found[-1], weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def write_atomic(path: Path, text: str) -> None:
    """Other ranks read these markers while this one writes them: never show a torn file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for(gate: str) -> None:
    while gate and not os.path.exists(gate):
        time.sleep(0.01)


def solo(args: argparse.Namespace, rank: int, optimizer: torch.optim.Optimizer) -> None:
    for spec in args.solo:
        who, count, *gate = spec.split(":", 2)
        if int(who) == rank:
            wait_for(gate[0] if gate else "")
            for _ in range(int(count)):
                optimizer.step()
            log(rank, f"solo {count} steps")


class ByHand:
    """A linear model and its SGD written out: the gradient summed with ``all_reduce``."""

    def __init__(self, world: int) -> None:
        self.w, self.world = torch.zeros(32, 1), world

    def step(self, data: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = data @ self.w - target
        grad = 2 * data.T @ error / len(data)
        dist.all_reduce(grad)
        self.w -= 0.01 * grad / self.world
        return (error**2).mean()

    def resume(self, ckpt_dir: Path) -> int:
        found = sorted(ckpt_dir.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
        if not found:
            return 0
        state = torch.load(found[-1], weights_only=True)
        self.w = state["w"]
        return int(state["step"])


def prepare(done: Path) -> None:
    """Busy on the CPU, printing nothing, until ``done`` exists (600 s at most)."""
    deadline, x = time.monotonic() + 600.0, 1.0
    while not done.exists() and time.monotonic() < deadline:
        for _ in range(100_000):
            x = x * 1.0000001 + 1e-9


def main() -> None:  # noqa: PLR0912, PLR0915 (a training script, read top to bottom)
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.prepare_until:  # rank 0 prepares the data; the others wait for it
        if rank == 0:
            prepare(Path(args.prepare_until))
        dist.barrier()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if args.no_optimizer:
        by_hand: ByHand | None = ByHand(world)
        start = by_hand.resume(ckpt_dir)
    else:
        by_hand = None
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        start = resume(ckpt_dir, model, optimizer)
    log(rank, f"resumed from step {start}" if start else f"fresh start (world {world})")
    crashed = ckpt_dir / f".crashed-rank-{args.crash_rank}"
    last = args.steps
    if crashed.exists() and args.stop_after_crash >= 0:
        last = min(last, int(crashed.read_text()) + args.stop_after_crash)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    target = data.sum(dim=1, keepdim=True)
    for step in range(start + 1, last + 1):
        times = ckpt_dir / f".crashes-rank-{args.crash_rank}"
        mine = rank == args.crash_rank
        count = int(times.read_text()) if mine and times.exists() else 0
        at = args.crash_at_step + args.crash_step_shift * count
        due = step >= at and args.crash_at_step >= 0 and mine
        if (
            due
            and count < args.crash_times
            and (not args.crash_when or Path(args.crash_when).exists())
        ):
            write_atomic(crashed, str(step))
            write_atomic(times, str(count + 1))
            log(rank, f"crashing at step {step}")
            raise RuntimeError(f"injected crash of rank {rank} at step {step}")
        exited = ckpt_dir / f".exited-rank-{rank}"
        if step == args.exit_at_step and rank == args.exit_rank and not exited.exists():
            exited.touch()
            log(rank, f"crashing at step {step} (exit 13, no traceback)")
            print(f"injected exit of rank {rank} at step {step}", file=sys.stderr, flush=True)
            os._exit(13)
        hung = ckpt_dir / f".hung-rank-{rank}"
        if step == args.hang_at_step and rank == args.hang_rank and not hung.exists():
            hung.touch()
            log(rank, f"hanging at step {step} ({args.hang_how})")
            if args.hang_how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            while True:
                time.sleep(3600)
        if by_hand is not None:
            loss = by_hand.step(data, target)
        else:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(data), target)
            loss.backward()
            optimizer.step()
        if rank == 0 or not args.quiet:
            log(rank, f"step {step} loss {loss.item():.4f}")
        if step % args.ckpt_every == 0 and rank == 0:
            tmp = ckpt_dir / f".ckpt-{step}.tmp"
            state = (
                {"w": by_hand.w, "step": step}
                if by_hand is not None
                else {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                }
            )
            torch.save(state, tmp)
            tmp.rename(ckpt_dir / f"ckpt-{step}.pt")
        paused, pause_s = ckpt_dir / f".paused-rank-{rank}", 0.0
        if step == args.pause_at_step and not paused.exists():
            paused.touch()
            log(rank, f"pausing at step {step} for {args.pause_s:g} s")
            pause_s = args.pause_s  # an evaluation: no training step meanwhile
        time.sleep(args.step_time_s + pause_s)
    dist.barrier()
    if by_hand is None:
        solo(args, rank, optimizer)
    log(rank, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
