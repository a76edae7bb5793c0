"""What the optimizer step hook (aegis.autoprogress) costs per step.

Usage: python benchmarks/step_hook.py [--steps 20000] [--rounds 7]

A tight loop of ``optimizer.step()`` (SGD, the cheapest torch optimizer, on a tiny model: the
worst case for a per-step cost) under an agent's progress file, with and without the hook,
rounds interleaved (with, without, without, with, ...) so that drift hits both alike; the median
and the best round of each and their ratios (on a loaded machine the best rounds are the steadier
figure); Adam on a 1M-parameter layer for a step of realistic size. Also the hook alone (called
directly) and ``aegis.progress`` for scale. And a whole training step of the tiny model (forward,
backward, ``optimizer.step()``), where each step also arms the one-shot forward pre-hook that
measures the input time (the straggler scores): its cost per step, registration, one call in
the first forward and removal included.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from aegis import autoprogress
from aegis import training as progress
from aegis.agent import watchdog


def loop(optimizer: torch.optim.Optimizer, steps: int) -> float:
    """Seconds per step of ``steps`` optimizer steps."""
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return (time.perf_counter() - started) / steps


def train_loop(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, steps: int
) -> float:
    """Seconds per step of ``steps`` whole training steps (forward, backward, step)."""
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        model(data).sum().backward()
        optimizer.step()
    return (time.perf_counter() - started) / steps


def per_call(call: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def hook_on(on: bool) -> None:
    if on and autoprogress._steps.handle is None:
        autoprogress._register(sys.modules[autoprogress.OPTIMIZER_MODULE])
    elif not on:
        autoprogress._remove()


def compare(
    optimizer: torch.optim.Optimizer,
    steps: int,
    rounds: int,
    run: Callable[[int], float] | None = None,
) -> dict[bool, list[float]]:
    """Per-step seconds of each round, with the hook (True) and without, interleaved."""
    measure = run or (lambda n: loop(optimizer, n))
    measure(max(1, steps // 10))  # warm up
    times: dict[bool, list[float]] = {True: [], False: []}
    for index in range(rounds):
        for on in (True, False) if index % 2 == 0 else (False, True):
            hook_on(on)
            times[on].append(measure(steps))
    hook_on(True)
    return times


def optimizer_of(
    model: torch.nn.Module, kind: Callable[..., torch.optim.Optimizer]
) -> torch.optim.Optimizer:
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    return kind(model.parameters(), lr=0.0)


def report(name: str, times: dict[bool, list[float]]) -> None:
    with_hook, without = statistics.median(times[True]), statistics.median(times[False])
    best_with, best_without = min(times[True]), min(times[False])
    print(f"{name}: median {without * 1e6:.2f} us a step without the hook, {with_hook * 1e6:.2f} "
          f"us with it: ratio {with_hook / without:.3f}; best round {best_without * 1e6:.2f} vs "
          f"{best_with * 1e6:.2f} us: ratio {best_with / best_without:.3f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    shared = watchdog.ProgressFile()
    os.environ[progress.ENV_VAR] = shared.path
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, torch {torch.__version__}; medians of {args.rounds} "
          "interleaved rounds")  # fmt: skip
    try:
        tiny = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        sgd = optimizer_of(tiny, torch.optim.SGD)
        assert autoprogress.install(), "not installed"
        report(
            f"SGD, 2.2k parameters, {args.steps} steps a round",
            compare(sgd, args.steps, args.rounds),
        )
        seen = shared.read()
        assert seen is not None and seen[0] > 0, "the hook reported nothing"
        data = torch.randn(8, 32)
        whole = max(1, args.steps // 4)
        report(
            f"SGD training step (forward, backward, step) with the input-time hook, {whole} "
            "steps a round",
            compare(sgd, whole, args.rounds, lambda n: train_loop(tiny, sgd, data, n)),
        )
        assert shared.input_s() is not None, "the input time was not measured"
        big = torch.nn.Linear(1024, 1024)
        steps = max(1, args.steps // 100)
        adam = optimizer_of(big, torch.optim.Adam)
        report(f"Adam, 1.05M parameters, {steps} steps a round", compare(adam, steps, args.rounds))
        # both calls in one lambda's tuple, the expression these figures were measured with:
        # mypy flags the None of _arm_input and _before_forward in it (func-returns-value)
        armed = min(  # arm, the first forward (torch's hook path for one module), removal
            per_call(lambda: (autoprogress._arm_input(), tiny(data)), args.steps)  # type: ignore[func-returns-value]
            for _ in range(args.rounds)
        )
        bare = min(per_call(lambda: tiny(data), args.steps) for _ in range(args.rounds))
        input_hook = per_call(
            lambda: (autoprogress._arm_input(), autoprogress._before_forward(None, ())),  # type: ignore[func-returns-value]
            args.steps,
        )
        alone = per_call(lambda: autoprogress._after_step(sgd, (), {}), args.steps)
        explicit = per_call(lambda: progress.report(1), args.steps)
    finally:
        shared.close()
    print(f"the hook alone: {alone * 1e9:.0f} ns a call; aegis.progress: {explicit * 1e9:.0f} ns")
    print(f"the input-time hook alone (arm, call, remove): {input_hook * 1e9:.0f} ns; the tiny "
          f"model's forward {bare * 1e6:.2f} us bare, {armed * 1e6:.2f} us armed (best of "
          f"{args.rounds}): {(armed - bare) * 1e9:.0f} ns a step")  # fmt: skip


if __name__ == "__main__":
    main()
