"""What the agent (PID 1 of its pod) holds once training runs, and how long its bootcheck takes.

Run: .venv/bin/python benchmarks/agent_footprint.py [--nodes N] [--rounds R] [--tree LABEL=SRC ...]

Each round runs ``aegis run --nodes N`` once per source tree, side by side (alternating, so a
noisy machine hurts each alike), with a command that never imports aegis nor torch: it says it
is up and waits to be released. While every rank waits, the script reads each agent's RSS and
whether it maps torch, and the RSS of its check forkserver; after the run it reads each pod's
bootcheck (runtime + allreduce_connect, from events.jsonl). ``--tree before=/tmp/old/src``
compares another checkout (its ``src`` put first on PYTHONPATH); ``this`` is the installed one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

WAITER = """\
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / f"up-{os.environ['RANK']}").write_text(str(os.getpid()))
while not (out / "release").exists():
    time.sleep(0.05)
"""


def wait_for(check: object, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.05)


def agents_of(run: psutil.Process) -> list[psutil.Process]:
    found = []
    for proc in run.children(recursive=True):
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if "-m" in argv and "aegis" in argv and "agent" in argv:
            found.append(proc)
    return found


def maps_torch(proc: psutil.Process) -> bool:
    return any("torch" in m.path for m in proc.memory_maps())


def one_run(src: str | None, nodes: int, work: Path) -> dict[str, list[float]]:
    work.mkdir(parents=True)
    (work / "waiter.py").write_text(WAITER)
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "aegis", "run", "--nodes", str(nodes), "--spare-nodes", "0",
            "--view", "plain", "--log-dir", str(work / "logs"), "--",
            sys.executable, str(work / "waiter.py"), str(work)]  # fmt: skip
    run = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list(work.glob("up-*"))) == nodes, 240, "every rank up")
        parent = psutil.Process(run.pid)
        agents = agents_of(parent)
        servers = [
            p
            for a in agents
            for p in a.children()
            if "aegis.checks.forkserver" in " ".join(p.cmdline())
        ]
        figures: dict[str, list[float]] = {
            "agent_rss_mb": [round(a.memory_info().rss / 2**20, 1) for a in agents],
            "agent_maps_torch": [maps_torch(a) for a in agents],
            "forkserver_rss_mb": [round(s.memory_info().rss / 2**20, 1) for s in servers],
        }
        (work / "release").write_text("")
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    boot = []
    for line in (work / "logs" / "events.jsonl").open():
        event = json.loads(line)
        if event.get("type") == "Finish" and event.get("phase") == "BootChecking":
            results = event["data"]["response"]["results"]
            boot.append(round(sum(r["duration_s"] for r in results), 3))
    figures["bootcheck_s"] = boot
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=SRC (repeatable)")
    args = parser.parse_args()
    trees = [("this", None)] + [tuple(t.split("=", 1)) for t in args.tree]
    seen: dict[str, dict[str, list[float]]] = {label: {} for label, _ in trees}
    with tempfile.TemporaryDirectory(prefix="aegis-footprint-") as tmp:
        for round_ in range(args.rounds):
            for label, src in trees:
                figures = one_run(src, args.nodes, Path(tmp) / f"{label}-{round_}")
                print(label, json.dumps(figures), flush=True)
                for key, values in figures.items():
                    seen[label].setdefault(key, []).extend(float(v) for v in values)
    print(f"machine: {platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}")
    for label, figures in seen.items():
        line = ", ".join(f"{k} median {statistics.median(v):g}" for k, v in figures.items())
        print(f"{label}: {line}")


if __name__ == "__main__":
    main()
