"""Run a command while other processes keep every core busy, and say how it went (issue 17).

Usage: python benchmarks/under_hog.py [--hogs N] [--repeat K] [--until-fail] -- CMD...

``--hogs N`` busy-loop processes (default: one per core) run beside the command, at the same
priority, for as long as it runs: the loaded 2-core machine the test suite must pass on. The
command runs ``--repeat K`` times in a row (stopping at the first failure with ``--until-fail``).
Prints one line per run (exit status, wall time, the load average over the run) and a summary; the
exit status is 0 only when every run passed. For the record in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import time


def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with contextlib.suppress(OSError, AttributeError):  # die with the parent, however it ends
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    while True:
        pass


PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the hogs stop with us
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--until-fail", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = [c for c in args.command if c != "--"] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (after --)")
    ctx = multiprocessing.get_context("spawn")
    hogs = [ctx.Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    passed = 0
    started_all = time.monotonic()
    try:
        for run in range(1, args.repeat + 1):
            started = time.monotonic()
            rc = subprocess.run(command, check=False).returncode
            wall_s = time.monotonic() - started
            load = os.getloadavg()[0]
            verdict = "passed" if rc == 0 else f"FAILED (exit {rc})"
            print(f"under_hog: run {run}/{args.repeat} {verdict} in {wall_s:.0f} s "
                  f"(load {load:.1f}, {args.hogs} hogs)", flush=True)  # fmt: skip
            passed += rc == 0
            if rc != 0 and args.until_fail:
                break
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.join()
    total_s = time.monotonic() - started_all
    print(f"under_hog: {passed}/{args.repeat} passed in {total_s:.0f} s", flush=True)
    return 0 if passed == args.repeat else 1


if __name__ == "__main__":
    sys.exit(main())
