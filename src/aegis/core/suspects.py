"""Which pod a hang is about, from the stacks its pods reported (no I/O).

In a synchronous job a stall stops every rank: the one that is stuck, and all the others that
wait for it inside a collective. Each pod's watchdog fires and sends the stacks of its training
processes (py-spy dumps, ``--- pid N (cmdline) ---`` sections). The pod to blame is the one that
is *not* where the others are:

1. some pods wait in a collective (a ``torch.distributed`` frame, DDP's synchronous parts, the
   autograd engine a DDP backward waits in) and exactly one reported pod is somewhere else:
   that one;
2. every pod that reported waits in a collective and exactly one pod of the job reported no
   hang (it is busy elsewhere, e.g. looping): that one;
3. no pod waits in a collective, three or more reported and all but one stand at the same
   frame: the odd one.

First, where torch's flight recorder was on (``flight recorder:`` lines, one per process,
from :func:`flight_line`), its counts decide: in a synchronous job every rank enqueues the same
collectives in the same order, so the one pod whose processes enqueued fewer than every other
reporting pod's is the one the others wait for.

Then, before the stack rules, a process the kernel holds says where the stall is: one pod whose
worker is stopped (``T``: SIGSTOP, Ctrl-Z, a freezer; ``t``: a debugger) or stays in
uninterruptible sleep (``D``: a disk, NFS or a GPU driver that does not return), each agent's
``process state:`` line (:func:`state_line`), while no other pod's is: that one. Its stack
often cannot be read at all (py-spy fails on a stopped process and waits on one in ``D``), so
rule 1 cannot see it.

Otherwise nobody is named (``None``): the hang is counted, but no pod (and so no node) is marked
slow for it. A torchrun launcher's own stack (it waits for its workers) is not evidence.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SECTION = re.compile(r"^--- pid (\d+) \((.*)\) ---$", re.MULTILINE)
_THREAD = re.compile(r'^Thread \S+ \([^)]*\): "(.*)"$')
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "aegis.agent")
_AUTOGRAD_WAIT = {"_engine_run_backward", "run_backward", "backward"}
FLIGHT_PREFIX = "flight recorder: "
STATE_PREFIX = "process state: "
HELD_STATES = {
    "T": "stopped (a stop signal or a freezer)",
    "t": "stopped by a debugger",
    "D": "in uninterruptible sleep (held in the kernel: a disk, NFS or a driver)",
}
_STATE = re.compile(r"^process state: (\S)", re.M)
# A count has at most 19 digits (an int64's): a line with more is a peer's invention, not read
# (a number of 5,000 digits made ``int`` raise and lost every hang report of the round).
_FLIGHT = re.compile(
    r"^flight recorder: collective #(-?\d{1,19}) enqueued, #(-?\d{1,19}) completed", re.M
)


@dataclass(frozen=True, slots=True)
class Suspect:
    pod: str
    why: str


@dataclass(frozen=True, slots=True)
class _View:
    """A pod's main threads, reduced: whether they wait in a collective, and where they are."""

    known: bool  # some worker's stack was readable
    waiting: bool
    where: str  # the innermost frame, "func (file)"; the collective's, when waiting
    held: str = ""  # "process N is <state>" when the kernel holds a worker (``state_line``)


def _frames(dump: str) -> list[tuple[str, str]]:
    """(function, file) of the first (main) thread in one py-spy dump, innermost first."""
    frames: list[tuple[str, str]] = []
    in_thread = False
    for line in dump.splitlines():
        if _THREAD.match(line.strip()):
            if in_thread:
                break
            in_thread = True
            continue
        if in_thread:
            frame = frame_of(line)
            if frame is None:
                if frames:
                    break
                continue
            frames.append(frame)
    return frames


def frame_of(line: str) -> tuple[str, str] | None:
    """(function, file) of one frame line of a py-spy dump, ``    func (path/file.py:12)``;
    None for any other line. Read by hand in one pass: the stacks are a peer's text, and the
    regular expression this replaces took time growing with the square of a line's length (a
    line of 12,000 characters took 0.9 s; one of 250 KB, as a message may hold, would hold the
    master's loop for about six minutes)."""
    if not line[:1].isspace():
        return None
    text = line.strip()
    cut = text.find(" (")
    if cut < 0 or not text.endswith(")"):
        return None
    func, inner = text[:cut], text[cut + 2 : -1]
    if not inner:
        return None
    head, colon, number = inner.rpartition(":")
    if colon and head and number.isdecimal():
        return func, head
    return func, inner


def _waits_at(frames: list[tuple[str, str]]) -> tuple[str, str] | None:
    for func, file in frames:
        if "torch/distributed/" in file or file.endswith("torch/nn/parallel/distributed.py"):
            return func, file
        if "torch/autograd/" in file and func in _AUTOGRAD_WAIT:
            return func, file
    return None


def _short(frame: tuple[str, str]) -> str:
    func, file = frame
    return f"{func} ({file.rsplit('/', 1)[-1]})"


def state_line(before: str, after: str) -> str:
    """The ``process state:`` line of a process whose scheduler state was ``before`` a stack
    dump and ``after`` it (``/proc/PID/stat``'s letter, "" when unread): stopped when it was
    before (it stays so), in uninterruptible sleep only when it was both times (a moment in
    ``D`` is an ordinary page fault or write); "" for any other."""
    if before in ("T", "t") or before == after == "D":
        return f"{STATE_PREFIX}{before}, {HELD_STATES[before]}"
    return ""


def view(stacks: str) -> _View:
    """What one pod's reported stacks show."""
    sections = list(_SECTION.finditer(stacks))
    wheres: list[str] = []
    waiting: list[str] = []
    held = ""
    for index, section in enumerate(sections):
        cmdline = section.group(2)
        if any(name in cmdline for name in _LAUNCHERS):
            continue
        end = sections[index + 1].start() if index + 1 < len(sections) else len(stacks)
        body = stacks[section.end() : end]
        if not held and (state := _STATE.search(body)) and state.group(1) in HELD_STATES:
            held = f"process {section.group(1)} is {HELD_STATES[state.group(1)]}"
        frames = _frames(body)
        if not frames:
            continue
        wait = _waits_at(frames)
        if wait is not None:
            waiting.append(_short(wait))
        else:
            wheres.append(_short(frames[0]))
    if wheres:  # any worker of the pod outside a collective: the pod is elsewhere
        return _View(True, False, wheres[0], held)
    if waiting:
        return _View(True, True, waiting[0], held)
    return _View(False, False, "", held)


def flight_line(dump: Mapping[str, Any]) -> str:
    """One process's flight recorder dump (torch's JSON, decoded) in one line: the default
    process group's last enqueued and last completed collective, and the newest entry's name and
    state; "" for a dump without them, or one not of that shape (the job's output: any JSON)."""
    groups, entries = dump.get("pg_status"), dump.get("entries")
    entries = [] if entries is None else entries  # none recorded yet
    if not isinstance(groups, Mapping) or not groups or not isinstance(entries, list):
        return ""
    if not all(isinstance(e, Mapping) for e in entries):
        return ""
    key = "0" if "0" in groups else sorted(groups, key=str)[0]
    status = groups[key]
    if not isinstance(status, Mapping):
        return ""
    try:
        enqueued = int(status.get("last_enqueued_collective", -1))
        completed = int(status.get("last_completed_collective", -1))
    except (TypeError, ValueError, OverflowError):  # a list, "x", 1e999 (JSON's Infinity)
        return ""
    mine = [e for e in entries if str(e.get("pg_id", key)) == str(key)] or entries
    last = ""
    if mine:
        name, state = str(mine[-1].get("profiling_name", "?")), str(mine[-1].get("state", "?"))
        last = f" (newest {name[:60]}, {state[:20]})"
    return f"{FLIGHT_PREFIX}collective #{enqueued} enqueued, #{completed} completed{last}"


def _flight_suspect(reports: Mapping[str, str]) -> Suspect | None:
    """The one pod that enqueued fewer collectives than every other pod with a flight record."""
    enqueued: dict[str, int] = {}
    for pod, text in reports.items():
        counts = [int(m.group(1)) for m in _FLIGHT.finditer(text)]
        if counts:
            enqueued[pod] = min(counts)  # a pod's slowest process
    if len(enqueued) < 2:
        return None
    low = min(enqueued.values())
    behind = [pod for pod, count in enqueued.items() if count == low]
    if len(behind) != 1:
        return None
    ahead = Counter(count for pod, count in enqueued.items() if pod != behind[0])
    common, _ = ahead.most_common(1)[0]
    others = len(enqueued) - 1
    return Suspect(
        behind[0],
        f"enqueued collective #{low} while {others} other pod{'s' if others != 1 else ''} "
        f"enqueued #{common} (flight recorder)",
    )


def name_suspect(reports: Mapping[str, str], pods: Sequence[str]) -> Suspect | None:
    """The pod a hang is about, given the stacks each reporting pod sent (``pods``: every pod
    of the job that was running); None when the stacks do not single one out."""
    if (flown := _flight_suspect(reports)) is not None:
        return flown
    views = {pod: view(text) for pod, text in reports.items()}
    known = {pod: v for pod, v in views.items() if v.known}
    waiting = sorted(pod for pod, v in known.items() if v.waiting)
    held = sorted(pod for pod, v in views.items() if v.held)
    if len(held) == 1 and len(views) >= 2:
        pod = held[0]
        peers = [p for p in waiting if p != pod]
        others = _others(peers, known) if peers else f"{len(views) - 1} other pod(s) are not"
        return Suspect(pod, f"{views[pod].held} while {others}")
    elsewhere = sorted(pod for pod, v in known.items() if not v.waiting)
    if waiting and len(elsewhere) == 1:
        pod = elsewhere[0]
        return Suspect(pod, f"in {known[pod].where} while {_others(waiting, known)}")
    silent = sorted(pod for pod in pods if pod not in reports)
    if waiting and not elsewhere and len(known) == len(reports) and len(silent) == 1:
        return Suspect(silent[0], f"reported no hang while {_others(waiting, known)}")
    if not waiting and len(known) >= 3:
        counts = Counter(v.where for v in known.values())
        (common, many), *rest = counts.most_common()
        if many == len(known) - 1 and len(rest) == 1:
            pod = next(pod for pod, v in known.items() if v.where != common)
            why = f"in {known[pod].where} while the {many} others are in {common}"
            return Suspect(pod, why)
    return None


def _others(waiting: list[str], known: Mapping[str, _View]) -> str:
    where = Counter(known[pod].where for pod in waiting).most_common(1)[0][0]
    count = len(waiting)
    return f"{count} other pod{'s wait' if count != 1 else ' waits'} in {where}"
