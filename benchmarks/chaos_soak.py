"""A chaos soak on the emulated cluster: faults of every kind, one after another, in one job.

Usage: python benchmarks/chaos_soak.py [--faults 8] [--seed 1] [--nodes 3] [--spares 2]
[--kinds crash,agent,node] [--masters 1] [--work DIR] [--keep]

``aegis run --isolate-nodes`` runs ``tests/bin/hold_probe.py`` (gloo all_reduce every step, an
Aegis checkpoint every 2 steps; each incarnation of each rank records the step it resumed from,
the value it found there and the step the master told it, ``AEGIS_RESUME_STEP``). A seeded
random fault of the ``--kinds`` is injected once the job trains again and has committed twice
since the last one:
- ``crash``: a rank's training process SIGKILLed (restart in place);
- ``agent``: a pod's agent SIGKILLed (the pod ends with it, and comes back on its node);
- ``node``: every process in a node's namespaces SIGKILLed (a host losing power: the pod moves
  to a spare), while a spare is left;
- ``hang``: a rank's training process SIGSTOPped, while a spare is left (its peers wait in the
  all_reduce; the agents judge a hang by the calibrated timeout, at least 30 s; the master names
  the stopped rank's pod, restarts in place, and moves that pod to a spare at the next commit,
  planned and not counted);
- ``master``: the leading master SIGKILLed (``--masters`` N > 1), while another is alive: a
  standby takes the job over, nothing restarts and nothing is counted;
- ``nats``: the run's NATS server SIGKILLed (first waiting, where needed, until the run would
  start it again: it leaves a server that died 5 times in 60 s down): the run starts it again
  on its port, the master and the agents reconnect, nothing restarts and nothing is counted;
- ``slow``: a node turns slow, while a spare is left (every process in its namespaces stopped
  0.4 s of every 0.5 s, until its pod left it: the job's pace falls to a third or a half; the
  run gets
  ``--pace-window-s 3 --pace-drop 0.6``, and the node turns slow after 6 s of training): the
  pace watch sees the drop, the round of checks names the node, training restarts in place
  and the pod moves to a spare at the next commit; nothing is counted;
- ``restart-slow``: a rank's training SIGKILLed, and its node slow (as ``slow``) from when
  training restarted in place (after the crash's round of checks, which so find nothing): the
  crash is counted; the node's slowness is seen against the pace before the restart (the
  round's own pace would be its best), named by the next round of checks, and the pod moves to
  a spare at the next commit;
- ``takeover-slow``: as ``restart-slow``, and the leading master SIGKILLed right after the
  training (``--masters`` N > 1, while another is alive): the new leader carries out the
  restart, and finds the pace before it in the job's record (the pace watch's notes).
Then the job is told to finish. What must hold: the run exits 0 and the job succeeded; every
fault of the job was counted once (``recover_count``), a hang judged for each ``hang`` and for
nothing else; each pod of a hang or a slow node moved off its node; the nodes lost, hung on or
slow are the ones blacklisted, and the only ones a pod moved off; each restart (a recovery, a
round of checks, a planned move) restarted every rank once, all from the step the master
named, with that step's values; nothing of the run is left.
Prints one line per fault (its kind, the seconds until the job trained again, or was led or
served again, and until it committed) and a verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from aegis.adapters import lifecycle  # noqa: E402
from aegis.adapters.nats_server import RESTART_WINDOW_S, RESTARTS  # noqa: E402
from tests.cluster import (  # noqa: E402
    agent_of,
    holder_of,
    in_net_namespace_of,
    leftovers,
    master_pid,
)
from tests.jsonl import json_lines  # noqa: E402
from tests.waits import wait_until  # noqa: E402

PROBE = ROOT / "tests" / "bin" / "hold_probe.py"
KINDS = ("crash", "agent", "node", "hang", "master", "nats", "slow", "restart-slow",
         "takeover-slow")  # fmt: skip
SPARE_TAKERS = ("node", "hang", "slow", "restart-slow", "takeover-slow")  # each moves a pod to a
# spare
MOVES = ("hang", "slow", "restart-slow", "takeover-slow")  # each moves a pod at the next commit
SLOWS = ("slow", "restart-slow", "takeover-slow")  # each turns a node slow
RESTARTED_SLOWS = ("restart-slow", "takeover-slow")  # slow from a crash's restart in place on
MASTER_KILLS = ("master", "takeover-slow")  # each kills the leading master
# the restarts of every rank a fault makes: a hang or a slow node, one in place after the round
# of checks, one when the pod moves (and a crash's first)
RESTARTS_OF = {"crash": 1, "agent": 1, "node": 1, "hang": 2, "slow": 2, "restart-slow": 3,
               "takeover-slow": 3, "master": 0, "nats": 0}  # fmt: skip
PACE_WINDOW_S = 3  # the run's, with slow nodes
SLOW_STOP_S, SLOW_PERIOD_S = 0.4, 0.5  # stopped this long of every period (as --inject-fault
# NODE:slow does: a sleeping process is stopped too, so a slow node must be stopped most of it)
# faults of the job: each counted once
COUNTED = ("crash", "agent", "node", "hang", "restart-slow", "takeover-slow")
LEADS = re.compile(r"leads job default\.soak \(epoch (\d+)\)")  # a master taking the job


def waited(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """``wait_until``, looking five times a second: each look reads the event log or walks the
    process tree, and the soak must not load the machine it measures."""
    return wait_until(condition, timeout_s, what, poll_s=0.2)


def records(out: Path, rank: int) -> list[dict[str, Any]]:
    return json_lines(out / f"rank-{rank}.jsonl")


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    paths = [log_dir / "events.jsonl", log_dir / "default" / "soak" / "events.jsonl"]
    path = next((p for p in paths if p.exists()), paths[0])  # (the second with --masters)
    return [e for e in json_lines(path) if e.get("type") == kind]


@dataclass
class Soak:
    """One soak's run: where it writes, where its pods are, what was injected."""

    work: Path
    nodes: int
    masters: int
    placed: dict[str, str] = field(default_factory=dict)
    injected: list[str] = field(default_factory=list)
    moved: list[tuple[str, str]] = field(default_factory=list)  # (pod, node): must leave it
    lost: list[str] = field(default_factory=list)  # nodes that must be blacklisted
    slowing: list[threading.Thread] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)  # the soak ends
    trained_since: float = 0.0  # the first commit since the last fault (its ts)
    errors: list[str] = field(default_factory=list)  # of the soak's own threads
    run_pid: int = 0  # the ``aegis run`` (its NATS server is a descendant)
    nats_pids: set[int] = field(default_factory=set)  # the NATS servers killed
    nats_kills: list[float] = field(default_factory=list)  # when (monotonic seconds)
    killed_masters: set[int] = field(default_factory=set)

    @property
    def out(self) -> Path:
        return self.work / "out"

    @property
    def log_dir(self) -> Path:
        return self.work / "logs"

    def incarnations(self) -> int:
        return min(len(records(self.out, r)) for r in range(self.nodes))

    def leader(self) -> int | None:
        """The master that took the job last (the highest lease epoch), while it is alive
        (None: none has yet, or the last one is killed and none took over yet)."""
        epochs = {}
        for i in range(self.masters):
            path = self.log_dir / f"master-{i}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            found = [int(m) for m in LEADS.findall(text)]
            epochs[i] = max(found, default=-1)
        last = max(epochs, key=lambda i: epochs[i])
        return last if epochs[last] >= 0 and last not in self.killed_masters else None

    def until_trained(self, incarnations: int) -> tuple[float, float]:
        """Wait until every rank started its ``incarnations``-th incarnation (a master leads,
        a NATS server runs) and the job then committed twice; returns the seconds until the
        first and until the first commit."""
        started = time.monotonic()
        waited(lambda: self.incarnations() >= incarnations, 300,
                   f"every rank's incarnation {incarnations}")  # fmt: skip
        if self.masters > 1:
            waited(lambda: self.leader() is not None, 300, "a master leading the job")
        waited(self.nats_server, 300, "the run's NATS server")
        back_s = time.monotonic() - started
        commits = len(events(self.log_dir, "CheckpointCommitted"))
        waited(lambda: len(events(self.log_dir, "CheckpointCommitted")) > commits, 300,
                   "a commit")  # fmt: skip
        commit_s = time.monotonic() - started
        self.trained_since = events(self.log_dir, "CheckpointCommitted")[commits]["ts"]
        waited(lambda: len(events(self.log_dir, "CheckpointCommitted")) >= commits + 2, 300,
                   "two commits")  # fmt: skip
        self.placed = placements(self.nodes, events(self.log_dir, "PodRestarted"))[0]
        return back_s, commit_s

    def steady(self, seconds: float) -> None:
        """Wait until the job has committed for ``seconds`` since the last fault (the pace
        watch has a pace to compare with: a node that is slow from a round's start is not
        seen, as the best pace is that round's)."""
        waited(lambda: events(self.log_dir, "CheckpointCommitted")[-1]["ts"]
                   >= self.trained_since + seconds, 300, f"{seconds:g} s of training")  # fmt: skip

    def inject(self, kind: str, rank: int) -> str:
        pod = f"soak-{rank}"
        node = self.placed[pod]
        pids, sig, where = self._victims(kind, pod, rank)
        if None in pids:
            raise SystemExit(f"chaos soak: no process to signal for {kind} of {where}")
        if kind != "slow":  # (a slow node's processes are stopped and continued, not killed)
            signal_all([pid for pid in pids if pid is not None], sig)
        if kind in RESTARTED_SLOWS:  # once training restarted in place after the crash
            restarted = self.incarnations() + 1
            waited(lambda: self.incarnations() >= restarted, 300, "the restart in place")
        if kind in SLOWS:  # stopped and continued from now on
            self._slow_down(pod, node)
        self.injected.append(kind)
        if kind in SPARE_TAKERS:
            self.lost.append(node)
        if kind in MOVES:
            self.moved.append((pod, node))
        return f"{kind} {where} ({len(pids)} process(es))"

    def _victims(self, kind: str, pod: str, rank: int) -> tuple[list[int | None], int, str]:
        """The processes a fault signals, the signal, and where they are."""
        where = f"{pod} on {self.placed[pod]}"
        if kind in ("crash", "hang", *RESTARTED_SLOWS):
            pid = records(self.out, rank)[-1]["pid"]
            if kind == "takeover-slow":  # (the training first: the leader dies at its crash)
                return [pid, self._leader_pid()], signal.SIGKILL, f"{where}, master"
            return [pid], signal.SIGSTOP if kind == "hang" else signal.SIGKILL, where
        if kind == "agent":
            return [agent_of(self.log_dir, pod)], signal.SIGKILL, where
        if kind in ("node", "slow"):  # every process in the node's namespaces
            procs = in_net_namespace_of(holder_of(self.log_dir, self.placed[pod]))
            return list(procs), signal.SIGKILL, where
        if kind == "nats":
            pid = self.nats_server()
            self.nats_pids.update([] if pid is None else [pid])
            self.nats_kills.append(time.monotonic())
            return [pid], signal.SIGKILL, "the NATS server"
        return [self._leader_pid()], signal.SIGKILL, f"master-{self.leader()}"

    def _leader_pid(self) -> int | None:
        """The leading master's process, counted as killed."""
        leader = self.leader()
        assert leader is not None
        self.killed_masters.add(leader)
        return master_pid(self.log_dir, leader)

    def _slow_down(self, pod: str, node: str) -> None:
        """``node`` slow from now until ``pod`` left it (a thread: every process in the node's
        namespaces stopped ``SLOW_STOP_S`` of every ``SLOW_PERIOD_S``)."""
        before = len(events(self.log_dir, "PodRestarted"))

        def left() -> bool:
            later = events(self.log_dir, "PodRestarted")[before:]
            return any(e["pod"] == pod and e["node"] != node for e in later)

        def slow() -> None:
            pids: list[int] = []
            try:
                holder = holder_of(self.log_dir, node)
                while not left() and not self.done.is_set():
                    pids = in_net_namespace_of(holder)
                    signal_all(pids, signal.SIGSTOP)
                    time.sleep(SLOW_STOP_S)  # (the fault itself: a duty cycle, not a wait)
                    signal_all(pids, signal.SIGCONT)
                    time.sleep(SLOW_PERIOD_S - SLOW_STOP_S)
            except Exception as exc:  # (said in the verdict: the node stopped slowing)
                self.errors.append(f"slowing {node}: {exc!r}")
            finally:
                signal_all(pids, signal.SIGCONT)

        self.slowing.append(threading.Thread(target=slow, name=f"slow {node}", daemon=True))
        self.slowing[-1].start()

    def moves(self) -> list[str]:
        return placements(self.nodes, events(self.log_dir, "PodRestarted"))[1]

    def nats_server(self) -> int | None:
        """The run's NATS server now (one not killed: a new one once the run restarted it)."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.run_pid).children(recursive=True):
                if child.name() == "nats-server" and child.pid not in self.nats_pids:
                    return int(child.pid)
        return None

    def check(self, status: dict[str, Any]) -> list[str]:
        """What went wrong, as lines (none: the soak passed)."""
        wrong = []
        counted = sum(kind in COUNTED for kind in self.injected)
        if status.get("phase") != "Succeed":
            wrong.append(f"phase {status.get('phase')}")
        if status.get("recover_count") != counted:
            wrong.append(f"recover_count {status.get('recover_count')} for {counted} faults")
        restarts = sum(RESTARTS_OF[kind] for kind in self.injected)
        rounds = [records(self.out, r) for r in range(self.nodes)]
        if any(len(r) != restarts + 1 for r in rounds):
            wrong.append(f"incarnations per rank {[len(r) for r in rounds]}, not "
                         f"{restarts + 1} each")  # fmt: skip
        for k in range(1, min(len(r) for r in rounds)):
            wrong += resumed_wrong(k, [r[k] for r in rounds])
        hangs = events(self.log_dir, "HangJudged")
        if len(hangs) != self.injected.count("hang"):
            wrong.append(f"{len(hangs)} hang(s) judged for {self.injected.count('hang')} "
                         f"injected: {[h['reason'] for h in hangs]}")  # fmt: skip
        if stayed := [f"{pod} on {node}" for pod, node in self.moved if self.placed[pod] == node]:
            wrong.append(f"pod(s) not moved off a hung or slow node: {stayed}")
        listed = {entry["node"] for entry in status.get("error_nodes", [])}
        if listed != set(self.lost):
            wrong.append(f"blacklisted {sorted(listed)}, not the nodes lost, hung on or slow: "
                         f"{sorted(set(self.lost))}")  # fmt: skip
        moves = sum(kind in SPARE_TAKERS for kind in self.injected)
        if (seen := len(self.moves())) != moves:
            wrong.append(f"{seen} pod(s) moved to another node, not {moves}: {self.moves()}")
        wrong += self.errors
        if left := leftovers(self.log_dir):
            wrong.append(f"left running: {left}")
        return wrong


def placements(nodes: int, restarted: list[dict[str, Any]]) -> tuple[dict[str, str], list[str]]:
    """Where each pod is after the ``PodRestarted`` events ``restarted`` (each started on its
    own node), and each time a pod came back on another node than its last."""
    where, moved = {f"soak-{r}": f"node-{r}" for r in range(nodes)}, []
    for e in restarted:
        if e["node"] != where[e["pod"]]:
            moved.append(f"{e['pod']} {where[e['pod']]} -> {e['node']}")
        where[e["pod"]] = e["node"]
    return where, moved


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def resumed_wrong(k: int, recs: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the ``k``-th incarnation of every rank (``recs``)."""
    wrong = []
    told = {rec["resume_step"] for rec in recs}
    if len(told) != 1 or None in told:
        wrong.append(f"recovery {k}: resume steps {sorted(map(str, told))}")
    for rec in recs:
        if rec["resume_step"] is not None and rec["resumed_from"] != int(rec["resume_step"]):
            wrong.append(f"recovery {k}: rank {rec['rank']} resumed from "
                         f"{rec['resumed_from']}, told {rec['resume_step']}")  # fmt: skip
        if rec["found"] != (float(rec["resumed_from"]) if rec["resumed_from"] else None):
            wrong.append(f"recovery {k}: rank {rec['rank']} found {rec['found']} at "
                         f"step {rec['resumed_from']}")  # fmt: skip
    return wrong


def eligible(args: argparse.Namespace, soak: Soak, spares_left: int) -> list[str]:
    """The kinds a next fault may be: a node lost, a hang or a slow node only while a spare is
    left (its pod moves to one), a master's loss only while two are alive."""
    kinds = [k for k in args.kinds if k not in (*SPARE_TAKERS, *MASTER_KILLS)]
    kinds += [k for k in SPARE_TAKERS
              if k in args.kinds and spares_left > 0 and k not in MASTER_KILLS]  # fmt: skip
    alive = args.masters - len(soak.killed_masters)
    kinds += [k for k in MASTER_KILLS if k in args.kinds and alive >= 2
              and (k not in SPARE_TAKERS or spares_left > 0)]  # fmt: skip
    if not kinds:
        done = f"{len(soak.injected)} of {','.join(args.kinds)}"
        raise SystemExit(f"chaos soak: no kind of fault left after {done}: more --spares or "
                         "--masters, or other --kinds")  # fmt: skip
    return kinds


def nats_may_die(soak: Soak) -> None:
    """Wait until the run would start its NATS server again (it leaves a server that died
    ``RESTARTS`` times within ``RESTART_WINDOW_S`` down): a seed's faults do not depend on
    how fast the soak ran."""
    if len(soak.nats_kills) >= RESTARTS - 1:
        oldest = soak.nats_kills[-(RESTARTS - 1)]
        waited(lambda: time.monotonic() - oldest > RESTART_WINDOW_S + 1.0, RESTART_WINDOW_S + 60,
               "the NATS server's restart window")  # fmt: skip


def run(args: argparse.Namespace, work: Path) -> list[str]:
    soak = Soak(work, args.nodes, args.masters)
    soak.placed = placements(args.nodes, [])[0]
    control, status_file = work / "control", work / "status.json"
    soak.out.mkdir()
    control.mkdir()
    argv = [sys.executable, "-m", "aegis.cli.main", "run", "--isolate-nodes", "--job", "soak",
            "--nodes", str(args.nodes), "--spare-nodes", str(args.spares),
            "--max-retry", str(args.faults + 1), "--heartbeat-timeout-s", "5",
            "--masters", str(args.masters), "--view", "plain", "--log-dir", str(soak.log_dir),
            "--status-file", str(status_file),
            *(["--pace-window-s", str(PACE_WINDOW_S), "--pace-drop", "0.6"]
              if set(SLOWS) & set(args.kinds) else []),
            "--", sys.executable, str(PROBE), str(soak.out), str(control)]  # fmt: skip
    rng = random.Random(args.seed)
    with (work / "run.log").open("wb") as log:
        # (dies with this script: a soak killed by a timeout leaves no job training for good)
        proc = subprocess.Popen(lifecycle.pdeath_argv(argv), stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT)  # fmt: skip
    soak.run_pid = proc.pid
    try:
        inject_all(args, soak, rng)
        (control / "finish").write_text("")
        rc = proc.wait(timeout=300)
    finally:
        soak.done.set()  # (no process left stopped)
        for thread in soak.slowing:
            thread.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status = json.loads(status_file.read_text())["status"] if status_file.exists() else {}
    return ([] if rc == 0 else [f"aegis run exited {rc}"]) + soak.check(status)


def inject_all(args: argparse.Namespace, soak: Soak, rng: random.Random) -> None:
    spares_left, expected = args.spares, 1
    for fault in range(args.faults + 1):
        back_s, commit_s = soak.until_trained(expected)
        if fault > 0:  # (a master's or NATS's loss: training went on)
            again = {"master": "led", "nats": "served"}.get(soak.injected[-1], "trained")
            print(f"  {again} again {back_s:5.1f} s, committed {commit_s:5.1f} s after the fault",
                  flush=True)  # fmt: skip
        if fault == args.faults:
            return
        kind = rng.choice(eligible(args, soak, spares_left))
        if kind in SLOWS:
            soak.steady(2 * PACE_WINDOW_S)
        if kind == "nats":
            nats_may_die(soak)
        spares_left -= kind in SPARE_TAKERS
        expected += RESTARTS_OF[kind]
        print(f"fault {fault + 1}: {soak.inject(kind, rng.randrange(args.nodes))}", end="",
              flush=True)  # fmt: skip


def kinds_arg(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or not set(kinds) <= set(KINDS):
        raise argparse.ArgumentTypeError(f"kinds are some of {','.join(KINDS)}, not {text!r}")
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--kinds", type=kinds_arg, default=kinds_arg("crash,agent,node"))
    parser.add_argument("--masters", type=int, default=1)
    parser.add_argument("--work", type=Path, help="an empty directory to work in")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if killing := [k for k in MASTER_KILLS if k in args.kinds and args.masters < 2]:
        parser.error(f"--kinds {killing[0]} wants --masters 2 or more (one takes over)")
    work = args.work or Path(tempfile.mkdtemp(prefix="aegis-soak-"))
    print(f"chaos soak: seed {args.seed}, {args.faults} faults of {','.join(args.kinds)}, "
          f"{args.nodes} nodes + {args.spares} spares, {args.masters} master(s), in {work}",
          flush=True)  # fmt: skip
    started = time.monotonic()
    wrong = run(args, work)
    took = time.monotonic() - started
    for line in wrong:
        print(f"WRONG: {line}")
    print(f"chaos soak: {'FAILED' if wrong else 'passed'} in {took:.0f} s ({work})")
    if not wrong and not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
