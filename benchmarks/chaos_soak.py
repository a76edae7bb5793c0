"""A chaos soak on the emulated cluster: faults of every kind, one after another, in one job.

Usage: python benchmarks/chaos_soak.py [--faults 8] [--seed 1] [--nodes 3] [--spares 2] [--work DIR]
[--keep]

``aegis run --isolate-nodes`` runs ``tests/bin/hold_probe.py`` (gloo all_reduce every step, an
Aegis checkpoint every 2 steps; each incarnation of each rank records the step it resumed from,
the value it found there and the step the master told it, ``AEGIS_RESUME_STEP``). A seeded
random fault is injected once the job trains again and has committed twice since the last one:
- ``crash``: a rank's training process SIGKILLed (restart in place);
- ``agent``: a pod's agent SIGKILLed (the pod ends with it, and comes back on its node);
- ``node``: every process in a node's namespaces SIGKILLed (a host losing power: the pod moves
  to a spare), while a spare is left.
Then the job is told to finish. What must hold: the run exits 0 and the job succeeded; every
fault was counted once (``recover_count``) and none was taken for a hang; each recovery
restarted every rank once, all from the step the master named, with that step's values;
nothing of the run is left.
Prints one line per fault (its kind, the seconds until the job trained again) and a verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from aegis.adapters import lifecycle  # noqa: E402
from tests.cluster import agent_of, holder_of, in_net_namespace_of, leftovers  # noqa: E402
from tests.waits import wait_until  # noqa: E402

PROBE = ROOT / "tests" / "bin" / "hold_probe.py"


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"rank-{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    path = log_dir / "events.jsonl"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e.get("type") == kind]


def until_trained(out: Path, log_dir: Path, ranks: int, incarnations: int) -> float:
    """Wait until every rank started its ``incarnations``-th incarnation and the job then
    committed twice; returns the seconds until the first."""
    started = time.monotonic()
    wait_until(lambda: all(len(records(out, r)) >= incarnations for r in range(ranks)),
               300, f"every rank's incarnation {incarnations}")  # fmt: skip
    back_s = time.monotonic() - started
    commits = len(events(log_dir, "CheckpointCommitted"))
    wait_until(lambda: len(events(log_dir, "CheckpointCommitted")) >= commits + 2, 300,
               "two commits")  # fmt: skip
    return back_s


def inject(kind: str, rank: int, ctx: dict[str, Any]) -> str:
    out, log_dir, placed = ctx["out"], ctx["log_dir"], ctx["placed"]
    pod = f"soak-{rank}"
    if kind == "crash":
        pids = [records(out, rank)[-1]["pid"]]
    elif kind == "agent":
        pids = [agent_of(log_dir, pod)]
    else:  # every process in the node's namespaces: a host that loses power
        pids = in_net_namespace_of(holder_of(log_dir, placed[pod]))
    for pid in pids:
        if pid is None:
            raise SystemExit(f"chaos soak: no process to kill for {kind} of {pod}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return f"{kind} {pod} on {placed[pod]} ({len(pids)} process(es))"


def check(out: Path, log_dir: Path, ranks: int, faults: int, status: dict[str, Any]) -> list[str]:
    """What went wrong, as lines (none: the soak passed)."""
    wrong = []
    if status.get("phase") != "Succeed":
        wrong.append(f"phase {status.get('phase')}")
    if status.get("recover_count") != faults:
        wrong.append(f"recover_count {status.get('recover_count')} for {faults} faults")
    rounds = [records(out, r) for r in range(ranks)]
    if any(len(r) != faults + 1 for r in rounds):
        wrong.append(f"incarnations per rank {[len(r) for r in rounds]}, not {faults + 1} each")
    for k in range(1, min(len(r) for r in rounds)):
        told = {r[k]["resume_step"] for r in rounds}
        if len(told) != 1 or None in told:
            wrong.append(f"recovery {k}: resume steps {sorted(map(str, told))}")
        for r in rounds:
            rec = r[k]
            if rec["resume_step"] is not None and rec["resumed_from"] != int(rec["resume_step"]):
                wrong.append(f"recovery {k}: rank {rec['rank']} resumed from "
                             f"{rec['resumed_from']}, told {rec['resume_step']}")  # fmt: skip
            if rec["found"] != (float(rec["resumed_from"]) if rec["resumed_from"] else None):
                wrong.append(f"recovery {k}: rank {rec['rank']} found {rec['found']} at "
                             f"step {rec['resumed_from']}")  # fmt: skip
    if hangs := events(log_dir, "HangJudged"):  # no fault injected here is a hang
        wrong.append(f"{len(hangs)} hang(s) judged: {[h['reason'] for h in hangs]}")
    if left := leftovers(log_dir):
        wrong.append(f"left running: {left}")
    return wrong


def soak(args: argparse.Namespace, work: Path) -> list[str]:
    out, control, log_dir = work / "out", work / "control", work / "logs"
    out.mkdir()
    control.mkdir()
    status_file = work / "status.json"
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--isolate-nodes", "--job", "soak",
            "--nodes", str(args.nodes), "--spare-nodes", str(args.spares),
            "--max-retry", str(args.faults + 1), "--heartbeat-timeout-s", "5",
            "--view", "plain", "--log-dir", str(log_dir), "--status-file", str(status_file),
            "--", sys.executable, str(PROBE), str(out), str(control)]  # fmt: skip
    rng = random.Random(args.seed)
    placed = {f"soak-{r}": f"node-{r}" for r in range(args.nodes)}
    ctx = {"out": out, "log_dir": log_dir, "placed": placed}
    spares_left = args.spares
    with (work / "run.log").open("wb") as log:
        # (dies with this script: a soak killed by a timeout leaves no job training for good)
        run = subprocess.Popen(lifecycle.pdeath_argv(argv), stdout=log, stderr=subprocess.STDOUT,
                               cwd=ROOT)  # fmt: skip
    try:
        for fault in range(args.faults + 1):
            back_s = until_trained(out, log_dir, args.nodes, fault + 1)
            for e in events(log_dir, "PodRestarted"):
                placed[e["pod"]] = e["node"]
            if fault > 0:
                print(f"  trained again {back_s:5.1f} s after the fault", flush=True)
            if fault == args.faults:
                break
            kinds = ["crash", "agent"] + (["node"] if spares_left > 0 else [])
            kind = rng.choice(kinds)
            spares_left -= kind == "node"
            print(f"fault {fault + 1}: {inject(kind, rng.randrange(args.nodes), ctx)}", end="",
                  flush=True)  # fmt: skip
        (control / "finish").write_text("")
        rc = run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    status = json.loads(status_file.read_text())["status"] if status_file.exists() else {}
    wrong = [] if rc == 0 else [f"aegis run exited {rc}"]
    return wrong + check(out, log_dir, args.nodes, args.faults, status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--work", type=Path, help="an empty directory to work in")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="aegis-soak-"))
    print(f"chaos soak: seed {args.seed}, {args.faults} faults, {args.nodes} nodes + "
          f"{args.spares} spares, in {work}", flush=True)  # fmt: skip
    started = time.monotonic()
    wrong = soak(args, work)
    took = time.monotonic() - started
    for line in wrong:
        print(f"WRONG: {line}")
    print(f"chaos soak: {'FAILED' if wrong else 'passed'} in {took:.0f} s ({work})")
    if not wrong and not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
