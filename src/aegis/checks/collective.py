"""The collective part of allreduce_connect / allreduce_perf, run as a child process.

``python -m aegis.checks.collective connect|perf --rank R --world-size W --master-addr A
--master-port P [...]`` joins a process group (TCP rendezvous on A:P; NCCL when CUDA is
available, else gloo), runs the round, and prints one JSON object ``{"passed", "result", ...}``
on stdout. The agent never holds a process group itself, and a hung collective dies with this
process when the check's budget runs out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

from aegis.checks import perf


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aegis.checks.collective")
    parser.add_argument("mode", choices=("connect", "perf"))
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--compute-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=0.2)
    parser.add_argument("--pair-repeats", type=int, default=5)
    parser.add_argument("--matrix", type=int, default=128)
    parser.add_argument("--pair-mb", type=float, default=1.0)
    parser.add_argument("--pair-iterations", type=int, default=4)
    parser.add_argument("--max-pair-rounds", type=int, default=3)
    parser.add_argument("--allreduce-mb", type=float, default=1.0)
    parser.add_argument("--slow-factor", type=float, default=0.6)
    parser.add_argument("--pair-slow-factor", type=float, default=0.35)
    return parser.parse_args(argv)


def _connect_round(torch: Any, dist: Any, rank: int, world: int, device: Any) -> dict[str, Any]:
    total = torch.tensor([float(rank + 1)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    expected_sum = world * (world + 1) / 2
    gathered = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([rank, rank * rank], dtype=torch.int64, device=device))
    got = [tuple(int(v) for v in t.tolist()) for t in gathered]
    want = [(r, r * r) for r in range(world)]
    if float(total.item()) != expected_sum:
        return {
            "passed": False,
            "result": f"all_reduce gave {total.item()}, expected {expected_sum}",
        }
    if got != want:
        return {"passed": False, "result": f"all_gather gave {got}, expected {want}"}
    return {"passed": True, "result": f"all_reduce and all_gather exact across {world} pod(s)"}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    started = time.monotonic()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = bool(torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    joined_s = time.monotonic() - started
    try:
        if args.mode == "connect":
            out = _connect_round(torch, dist, args.rank, args.world_size, device)
        else:
            out = perf.run_round(torch, dist, args, device)
        out["backend"] = backend
        out["join_s"] = round(joined_s, 3)
    finally:
        dist.destroy_process_group()
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no lingering gloo threads at interpreter exit
