"""The checks that need torch, run as a child process: runtime, allreduce_connect, allreduce_perf.

``python -m aegis.checks.collective MODES [--expect-cuda any|true|false] [--rank R --world-size W
--master-addr A --master-port P ...]`` (MODES: some of ``runtime``, ``connect``, ``perf``, in
that order, comma-separated) imports torch and prints one JSON object ``{"mode", "passed",
"result", "pid", ...}`` per mode on stdout as soon as that mode is done. ``runtime`` comes first
and needs no group: its result is the environment report (:mod:`aegis.checks.env`), or why torch
does not import. ``connect`` and ``perf`` join one process group (TCP rendezvous on A:P; NCCL when
CUDA is available, else gloo) and run each round in turn on it; after a failed ``connect`` it
stops. The agent never imports torch nor holds a process group itself: its memory stays small,
CUDA is never initialised in PID 1, and a hung collective dies with this process when the check's
budget runs out. The same :func:`main` runs in a child forked from the agent's warm check
interpreter (:mod:`aegis.checks.forkserver`), which has imported torch already.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

from aegis.checks import env, perf

MODES = ("runtime", "connect", "perf")
GROUP_MODES = ("connect", "perf")
EXPECT_CUDA = {"any": None, "true": True, "false": False}


def _modes(text: str) -> list[str]:
    modes = text.split(",")
    if modes != [m for m in MODES if m in modes]:
        raise argparse.ArgumentTypeError(f"modes must be among {','.join(MODES)}, in that "
                                         f"order: {text!r}")  # fmt: skip
    return modes


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m aegis.checks.collective")
    parser.add_argument("mode", type=_modes, help="e.g. runtime, connect,perf, runtime,connect")
    parser.add_argument("--expect-cuda", choices=sorted(EXPECT_CUDA), default="any")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
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
    args = parser.parse_args(argv)
    group = (args.rank, args.world_size, args.master_addr, args.master_port)
    if any(m in GROUP_MODES for m in args.mode) and None in group:
        parser.error("connect and perf need --rank, --world-size, --master-addr, --master-port")
    return args


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


def _say(out: dict[str, Any]) -> None:
    out.setdefault("pid", os.getpid())
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()  # each verdict as soon as its round is done


def _runtime_round(expect_cuda: bool | None) -> tuple[bool, dict[str, Any]]:
    """(whether torch imports, the runtime verdict): the environment report of this process."""
    try:
        report = env.environment_report()
    except Exception as exc:  # torch that does not import is a broken runtime
        reason = f"torch does not import: {type(exc).__name__}: {exc}"
        sys.stderr.write(reason + "\n")
        return False, {"mode": "runtime", "passed": False, "result": reason}
    passed, result = env.runtime_verdict(report, expect_cuda)
    return True, {"mode": "runtime", "passed": passed, "result": result}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    started = time.monotonic()
    if "runtime" in args.mode:
        imports, out = _runtime_round(EXPECT_CUDA[args.expect_cuda])
        _say(out)
        if not imports:
            return 1
    group_modes = [m for m in args.mode if m in GROUP_MODES]
    if group_modes:
        _group_rounds(args, group_modes, started)
    return 0


def _group_rounds(args: argparse.Namespace, modes: list[str], started: float) -> None:
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
        for mode in modes:
            round_started = time.monotonic()
            if mode == "connect":
                out = _connect_round(torch, dist, args.rank, args.world_size, device)
            else:
                out = perf.run_round(torch, dist, args, device)
            out.update(mode=mode, backend=backend, join_s=round(joined_s, 3),
                       round_s=round(time.monotonic() - round_started, 3))  # fmt: skip
            _say(out)
            if not out["passed"] and mode == "connect":
                break  # no perf round on a group that does not compute right
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no lingering gloo threads at interpreter exit
