"""What the restricted unpickling of a checkpoint's skeleton costs, side by side in one run.

Usage: python benchmarks/safe_pickle.py [--params 2000] [--repeat 20]

The state is a model's and an Adam optimizer's state dicts with ``--params`` small parameters
(the worst case for the skeleton: many leaves, few bytes). Measured, best of ``--repeat``:
``pickle.loads`` of the skeleton (what loading did before), ``safe_pickle.loads`` of it (what a
load and each save now do), and one steady ``Saver.save`` of the state into shared memory (the
saver daemon persists each save before the next is timed, so the save's own stall is measured:
the copy and the hand-off). Printed: each time, and the ratios safe/plain and check/save.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import functools
import pickle
import platform
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aegis.checkpoint import api, nested, process, safe_pickle


def state_of(params: int) -> dict[str, Any]:
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8)) for _ in range(params))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sum(p.sum() for p in model).backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


async def steady_save(state: dict[str, Any], shm: Path, repeat: int) -> float:
    ckpt = shm.with_name(shm.name + "-disk")
    daemon = process.DaemonProcess(process.DaemonSettings(shm_dir=shm, ckpt_dir=ckpt))
    await daemon.start()
    try:
        saver = api.Saver(api.SaverSettings(shm_dir=shm, ckpt_dir=ckpt))
        times = []
        for step in range(1, repeat + 2):
            start = time.perf_counter()
            saver.save(step, state)
            times.append(time.perf_counter() - start)
            while daemon.last_committed != step:  # persisted: the next save waits for nothing
                await daemon.poll_commits()
                await asyncio.sleep(0.01)
        return min(times[1:])  # the first maps the buffers
    finally:
        await daemon.stop()
        shutil.rmtree(ckpt, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    state = state_of(args.params)
    tensors: list[Any] = []
    skeleton = nested.rebuild(state, functools.partial(api._to_ref, tensors, torch))
    blob = pickle.dumps(skeleton, protocol=5)
    plain = best(lambda: pickle.loads(blob), args.repeat)
    safe = best(lambda: safe_pickle.loads(blob), args.repeat)
    shm = Path("/dev/shm") / f"aegis-bench-{uuid.uuid4().hex[:8]}"
    try:
        save = asyncio.run(steady_save(state, shm, args.repeat))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(f"# {datetime.date.today()} {platform.node()} torch {torch.__version__}")
    print(f"state: {args.params} parameters, {len(tensors)} tensors, skeleton {len(blob)} bytes")
    print(f"pickle.loads       {plain * 1e3:8.3f} ms")
    print(f"safe_pickle.loads  {safe * 1e3:8.3f} ms  ({safe / plain:.2f}x pickle.loads)")
    print(f"Saver.save steady  {save * 1e3:8.3f} ms  (the check is {safe / save:.1%} of it)")


if __name__ == "__main__":
    main()
