"""A small real DDP job (gloo on CPU) for Aegis demos and end-to-end tests.

Checkpoints every ``--ckpt-every`` steps, with ``aegis.checkpoint`` under an Aegis agent (each rank
into shared memory, persisted by the agent's saver) or else ``torch.save`` (rank 0, atomically);
resumes from the newest checkpoint, reports progress to the agent with ``aegis.progress(step)``
and logs one line per step with a timestamp. Chaos switches: ``--crash-at-step S --crash-rank R``
crashes rank R once with an uncaught exception (a marker in the checkpoint directory remembers
it; a software fault: Aegis restarts every rank in place at once); ``--exit-at-step S
--exit-rank R`` makes rank R exit 13 once with no traceback (an unexplained death: the master
runs its checks first); ``--always-crash-rank R`` crashes rank R in every incarnation. Under an
agent it also saves when the master asks (``aegis.checkpoint.save_if_requested``: a drain, a
slow node's eviction) unless ``--no-ckpt-requests`` (the baseline of a script that only
checkpoints periodically). For tests, however slow the machine: ``--hold-at-step S`` makes
every rank of a fresh start wait after step S until the master's checkpoint request has come (a
drain lands mid-run), ``--hold-at-end-until F`` makes every rank wait after the last step until
the file F exists (the job ends when the test is done with it); each at most two minutes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import aegis
import aegis.checkpoint
from aegis import training

SAVER = bool(os.environ.get("AEGIS_CKPT_DIR"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--ckpt-dir", default=os.environ.get("AEGIS_CKPT_DIR", "/tmp/aegis-ckpt"))
    p.add_argument("--step-time-s", type=float, default=0.01)
    p.add_argument("--crash-at-step", type=int, default=-1)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--always-crash-rank", type=int, default=-1)
    p.add_argument("--exit-at-step", type=int, default=-1)
    p.add_argument("--exit-rank", type=int, default=1)
    p.add_argument("--no-ckpt-requests", action="store_true")
    p.add_argument("--hold-at-step", type=int, default=-1)
    p.add_argument("--hold-at-end-until", default=None)
    return p.parse_args()


def newest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("ckpt-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def log(rank: int, message: str) -> None:
    now = datetime.datetime.now().isoformat(timespec="milliseconds")
    print(f"{now} rank={rank} {message}", flush=True)


def hold_for_request(rank: int, step: int, fresh: bool, at: int) -> None:
    """At step ``at`` of a fresh start, wait until a checkpoint request has come (whether or
    not this script takes requests)."""
    if step == at and fresh:
        hold(
            rank, step, "a checkpoint request", lambda: training.pending_request(None, opt_in=False)
        )


def hold_at_end(rank: int, step: int, release: str | None) -> None:
    if release is not None:
        hold(rank, step, f"{release} to exist", Path(release).exists)


def hold(rank: int, step: int, what: str, until: Callable[[], object]) -> None:
    """Wait (at most two minutes) until ``until()``, reporting progress meanwhile so that no
    hang is judged."""
    log(rank, f"holding at step {step} for {what}")
    deadline = time.monotonic() + 120
    while not until() and time.monotonic() < deadline:
        aegis.progress(step)
        time.sleep(0.05)


def main() -> None:  # noqa: PLR0915 (a training script, read top to bottom)
    args = parse()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    incarnation = int(
        os.environ.get("AEGIS_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    if SAVER:  # under an Aegis agent: its fast saver (shared memory, then disk)
        restored = aegis.checkpoint.load_latest()
        if restored is not None:
            start, state = restored
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            log(rank, f"resumed from aegis checkpoint at step {start} (incarnation {incarnation})")
    else:
        latest = newest_checkpoint(ckpt_dir)
        if latest is not None:
            state = torch.load(latest, weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
            log(rank, f"resumed from {latest.name} at step {start} (incarnation {incarnation})")
    if start == 0:
        log(rank, f"fresh start (incarnation {incarnation}, world {world})")
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    target = data.sum(dim=1, keepdim=True)
    for step in range(start + 1, args.steps + 1):
        if rank == args.always_crash_rank and step == start + 3:
            log(rank, f"crashing at step {step}")
            raise RuntimeError(f"injected crash of rank {rank} at step {step} (always)")
        marker = ckpt_dir / f".crashed-rank-{rank}"
        if step == args.crash_at_step and rank == args.crash_rank and not marker.exists():
            marker.touch()  # once per checkpoint directory, whoever relaunches the job
            log(rank, f"crashing at step {step}")
            raise RuntimeError(f"injected crash of rank {rank} at step {step}")
        marker = ckpt_dir / f".exited-rank-{rank}"
        if step == args.exit_at_step and rank == args.exit_rank and not marker.exists():
            marker.touch()
            log(rank, f"crashing at step {step} (exit 13, no traceback)")
            print(f"injected exit of rank {rank} at step {step}", file=sys.stderr, flush=True)
            os._exit(13)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(data), target)
        loss.backward()
        optimizer.step()
        aegis.progress(step)
        log(rank, f"step {step} loss {loss.item():.4f}")

        def state() -> dict[str, object]:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        if SAVER and not args.no_ckpt_requests and aegis.checkpoint.save_if_requested(step, state):
            log(rank, f"checkpoint at step {step} on request")  # (after a hold: never printed)
        elif step % args.ckpt_every == 0 and SAVER:
            aegis.checkpoint.save(step, state())  # blocks only for the copy to shared memory
        elif step % args.ckpt_every == 0 and rank == 0:
            tmp = ckpt_dir / f".ckpt-{step}.tmp"
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, tmp)
            tmp.rename(ckpt_dir / f"ckpt-{step}.pt")
        hold_for_request(rank, step, fresh=start == 0, at=args.hold_at_step)
        time.sleep(args.step_time_s)
    hold_at_end(rank, args.steps, args.hold_at_end_until)
    dist.barrier()
    log(rank, "done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
