"""The shape of PyTorch's DDP tutorial: one process starts its ranks with ``mp.spawn`` (no
torchrun), never imports aegis. ``mp_spawn_ddp.py CKPT [--steps N] [--crash-rank R --crash-at-step
S]``: rank 0 saves ``CKPT/ckpt.pt`` every 5 steps; every rank resumes from it and prints
``rank R starts at S (restart K)``; rank R raises once at step S (a marker in CKPT remembers)."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    path, start = os.path.join(args.ckpt, "ckpt.pt"), 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        start = int(state["step"])
    restart = os.environ.get("AEGIS_RESTART_COUNT", "0")
    print(f"rank {rank} starts at {start} (restart {restart})", flush=True)
    marker = os.path.join(args.ckpt, "crashed")
    for step in range(start, args.steps):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        if rank == 0 and (step + 1) % 5 == 0:
            torch.save({"model": model.state_dict(), "step": step + 1}, path + ".tmp")
            os.replace(path + ".tmp", path)
        if rank == args.crash_rank and step == args.crash_at_step and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError(f"injected crash in rank {rank}")
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--crash-rank", type=int, default=-1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parsed = parser.parse_args()
    os.makedirs(parsed.ckpt, exist_ok=True)
    mp.spawn(train, args=(2, parsed), nprocs=2, join=True)
