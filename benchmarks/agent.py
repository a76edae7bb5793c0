"""Agent benchmarks: restart-in-place latency and the cost of one aegis.progress() call.

Run: .venv/bin/python benchmarks/agent.py [--rounds N] [--torch-rounds N]

Restart latency is measured from the restart order (``Supervisor.restart()``) to the first output
line of the new incarnation, and compared with a cold start (``Supervisor.start()`` to the same
line) of the same command measured side by side: the difference is the agent's own overhead (stop
of the old group, bookkeeping, spawn). progress() is compared with an empty Python function call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from collections.abc import Callable

from aegis import training as progress
from aegis.agent import ports, reaper, supervisor, watchdog

TRIVIAL = ["sh", "-c", "echo ready; exec sleep 600"]
TORCH = [
    sys.executable,
    "-c",
    "import time, torch; print('ready', flush=True); time.sleep(600)",
]


async def time_starts(argv: list[str], rounds: int) -> tuple[list[float], list[float]]:
    """(cold start times, restart times), each from the order to the new child's first line."""
    ready = asyncio.Event()

    def observe(stream: str, line: bytes) -> None:
        if line.startswith(b"ready"):
            ready.set()

    devnull = os.open(os.devnull, os.O_WRONLY)
    settings = supervisor.SupervisorSettings(
        grace_s=5.0, hang_timeout_s=0, stdout_fd=devnull, stderr_fd=devnull
    )
    cold: list[float] = []
    restart: list[float] = []
    async with reaper.Reaper() as the_reaper:
        for _ in range(rounds):
            reports = ports.RecordingReports()
            async with supervisor.Supervisor(
                argv, settings, the_reaper, reports, observe=observe
            ) as sup:
                ready.clear()
                began = time.perf_counter()
                await sup.start()
                await ready.wait()
                cold.append(time.perf_counter() - began)
                ready.clear()
                began = time.perf_counter()
                await sup.restart()
                await ready.wait()
                restart.append(time.perf_counter() - began)
    os.close(devnull)
    return cold, restart


def progress_costs(number: int) -> dict[str, float]:
    """Seconds per call: empty function, aegis.progress() under an agent file, and without."""
    import aegis

    def empty(step: int) -> None:
        pass

    shared = watchdog.ProgressFile()
    os.environ[progress.ENV_VAR] = shared.path
    try:
        aegis.progress(0)  # maps the file
        costs = {}
        for name, call in (("empty function", empty), ("aegis.progress", aegis.progress)):
            # a def, not a lambda: mypy cannot infer a lambda with a default against timeit's type
            def once(call: Callable[[int], object] = call) -> object:
                return call(7)

            best = min(timeit.repeat(once, number=number, repeat=5))
            costs[name] = best / number
        assert shared.read() is not None and shared.read()[0] == 7  # type: ignore[index]
    finally:
        del os.environ[progress.ENV_VAR]
        shared.close()
    return costs


def machine() -> str:
    cpus = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return f"{cpus} CPUs, {platform.machine()}, Python {platform.python_version()}"


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms (min {min(values) * 1e3:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--torch-rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {machine()}; date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| child | cold start (median) | restart (median) | overhead (median diff) |")
    print("|---|---|---|---|")
    for name, argv, rounds in (
        ("`sh -c 'echo ready; exec sleep'`", TRIVIAL, args.rounds),
        ("`python -c 'import torch'`", TORCH, args.torch_rounds),
    ):
        cold, restart = asyncio.run(time_starts(argv, rounds))
        overhead = statistics.median(restart) - statistics.median(cold)
        print(f"| {name} x{rounds} | {ms(cold)} | {ms(restart)} | {overhead * 1e3:+.1f} ms |")
    costs = progress_costs(1_000_000)
    base = costs["empty function"]
    print()
    print("| call | cost per call | ratio to an empty function call |")
    print("|---|---|---|")
    for name, cost in costs.items():
        print(f"| {name} | {cost * 1e9:.0f} ns | {cost / base:.2f}x |")


if __name__ == "__main__":
    main()
