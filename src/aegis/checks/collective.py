"""The collective part of allreduce_connect / allreduce_perf, run as a child process.

``python -m aegis.checks.collective MODES --rank R --world-size W --master-addr A
--master-port P [...]`` (MODES: ``connect``, ``perf`` or ``connect,perf``) joins one process
group (TCP rendezvous on A:P; NCCL when CUDA is available, else gloo), runs each round in turn on
it, and prints one JSON object ``{"mode", "passed", "result", "pid", ...}`` per round on stdout as
soon as that round is done; after a failed ``connect`` it stops. The agent never holds a process
group itself, and a hung collective dies with this process when the check's budget runs out.
The same :func:`main` runs in a child forked from the agent's warm check interpreter
(:mod:`aegis.checks.forkserver`), which has imported torch already.
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

MODES = ("connect", "perf")


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes must be among {','.join(MODES)}: {text!r}")
    return modes


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aegis.checks.collective")
    parser.add_argument("mode", type=_modes, help="connect, perf or connect,perf")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--compute-s", type=float, default=0.5)
    parser.add_argument("--window-s", type=float, default=0.1)
    parser.add_argument("--pair-repeats", type=int, default=5)  # a noisy figure: best of 5
    parser.add_argument("--matrix", type=int, default=128)
    parser.add_argument("--pair-mb", type=float, default=1.0)
    parser.add_argument("--pair-iterations", type=int, default=4)
    parser.add_argument("--max-pair-rounds", type=int, default=3)
    parser.add_argument("--allreduce-mb", type=float, default=1.0)
    parser.add_argument("--slow-factor", type=float, default=0.6)
    parser.add_argument("--pair-slow-factor", type=float, default=0.25)
    parser.add_argument("--straggler-score", type=float, default=0.0)
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
        for mode in args.mode:
            round_started = time.monotonic()
            if mode == "connect":
                out = _connect_round(torch, dist, args.rank, args.world_size, device)
            else:
                out = perf.run_round(torch, dist, args, device)
            out.update(mode=mode, backend=backend, join_s=round(joined_s, 3), pid=os.getpid(),
                       round_s=round(time.monotonic() - round_started, 3))  # fmt: skip
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()  # each verdict as soon as its round is done
            if not out["passed"] and mode == "connect":
                break  # no perf round on a group that does not compute right
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no lingering gloo threads at interpreter exit
