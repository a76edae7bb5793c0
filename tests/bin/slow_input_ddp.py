"""A plain DDP job (gloo on CPU, no aegis import) with one rank slow before its forward: rank
``--slow-rank`` sleeps ``--slow-s`` before each step's forward (a slow data loader), so its peers
wait for it inside DDP's all_reduce and every rank ends each step together.

Usage: slow_input_ddp.py --steps N [--step-time-s S] [--slow-rank R] [--slow-s S]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time-s", type=float, default=0.01)
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--slow-s", type=float, default=0.02)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(32, 1))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(rank))
    target = data.sum(dim=1, keepdim=True)
    for step in range(1, args.steps + 1):
        if rank == args.slow_rank:
            time.sleep(args.slow_s)  # the slow data loader
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(data), target).backward()
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"rank={rank} step {step}", flush=True)
        time.sleep(args.step_time_s)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
