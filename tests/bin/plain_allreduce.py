"""A job with no step signal at all: gloo ``all_reduce`` in a loop, no optimizer, no aegis import,
and only rank 0 prints (every 10 steps). What the watchdog must judge by CPU and output alone.

usage: plain_allreduce.py --steps N [--step-time-s T] [--busy-s B] [--hang-at-step S
--hang-rank R --state-dir D]

Each step: B seconds of arithmetic (the CPU busy), an ``all_reduce``, T seconds of sleep.
``--hang-at-step S --hang-rank R``: rank R sleeps forever at step S, once (a marker in D
remembers it), while the others wait for it in ``all_reduce``. Rank 0 prints ``done`` at the end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def stuck_forever() -> None:
    while True:
        time.sleep(3600)


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 1.0
    while time.monotonic() < end:
        x = x * 1.0000001 + 1e-9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time-s", type=float, default=0.02)
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--hang-at-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=1)
    p.add_argument("--state-dir", default="/tmp/plain-allreduce")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    marker = Path(args.state_dir) / f".hung-rank-{args.hang_rank}"
    if rank == 0:
        print(f"start (world {dist.get_world_size()}, pid {os.getpid()})", flush=True)
    tensor = torch.ones(1024)
    for step in range(1, args.steps + 1):
        if step == args.hang_at_step and rank == args.hang_rank and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(step))
            stuck_forever()
        busy(args.busy_s)
        dist.all_reduce(tensor)
        tensor.fill_(1.0)
        if rank == 0 and step % 10 == 0:
            print(f"step {step}", flush=True)
        time.sleep(args.step_time_s)
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
