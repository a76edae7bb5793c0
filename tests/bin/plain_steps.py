"""Torch optimizer steps in a script that does not import aegis (unless told to call it).

usage: plain_steps.py STEPS [--optimizers N] [--progress-after K STEP] [--end exit|raise|pause]
[--hold-exit GATE] [--before GATE]

Makes STEPS iterations, each one ``step()`` of each of N SGD optimizers; with ``--progress-after
K STEP`` calls ``aegis.progress(STEP)`` after the K-th iteration (the only aegis import);
``--before GATE`` waits for the file GATE before the first step; then ends as told (``pause``
prints ``PAUSED`` and waits for a signal). ``--hold-exit GATE`` keeps the exiting interpreter
alive (an ``atexit`` handler) until GATE exists: the dying report must come before the exit.
Prints ``STEPPED <iterations> <torch imported>`` after the steps.
"""

import argparse
import atexit
import os
import signal
import sys
import time


def wait_for(gate: str) -> None:
    while gate and not os.path.exists(gate):
        time.sleep(0.01)


p = argparse.ArgumentParser()
p.add_argument("steps", type=int)
p.add_argument("--optimizers", type=int, default=1)
p.add_argument("--progress-after", type=int, nargs=2, default=None)
p.add_argument("--end", default="exit")
p.add_argument("--hold-exit", default="")
p.add_argument("--before", default="")
args = p.parse_args()
if args.hold_exit:
    atexit.register(wait_for, args.hold_exit)
print("STARTED torch" if "torch" in sys.modules else "STARTED", flush=True)

import torch  # noqa: E402

params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(args.optimizers)]
optimizers = [torch.optim.SGD([param], lr=0.1) for param in params]
wait_for(args.before)
for iteration in range(1, args.steps + 1):
    for param, optimizer in zip(params, optimizers, strict=True):
        param.grad = torch.ones(4)
        optimizer.step()
    if args.progress_after is not None and iteration == args.progress_after[0]:
        import aegis

        aegis.progress(args.progress_after[1])
print(f"STEPPED {args.steps}", flush=True)
if args.end == "raise":
    raise RuntimeError("plain script raised")
if args.end == "pause":
    print("PAUSED", flush=True)
    while True:
        signal.pause()
