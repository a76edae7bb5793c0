"""Breadth-first exploration of every reachable state of a job under the environment's moves.

A state is ``(status, faults_spent)``. For each state the checker applies every move through the
given ``step`` (the production one unless a test passes a mutant), checks the state invariants on
each new status and the transition invariants on each change, and keeps parent pointers so that a
violation comes with the shortest trace of events that leads to it. After the search it checks
liveness on the graph of cooperative moves: every non-terminal state can make progress without
new faults (no dead end), the cooperative graph has no cycle (so, with no further faults, the job
inevitably reaches Succeed or Failed) and a terminal phase is reachable from every state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import invariants as inv
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus, NodeName, initial_status
from aegis.core.phases import TERMINAL_PHASES
from aegis.tools.verify import environment

StepFn = Callable[[JobSpec, JobStatus, ev.Event, float], tuple[JobStatus, tuple[act.Action, ...]]]

LIVENESS = ("NoDeadlock", "FaultFreeTermination", "TerminalReachable")


@dataclass(frozen=True, slots=True)
class Bounds:
    faults: int  # disruptive events per run (errors, hangs, lost pods, restarts, bad answers)
    max_states: int  # safety valve: stop (and say so) past this many states


@dataclass(slots=True)
class Violation:
    invariant: str
    message: str
    trace: list[ev.Event]
    status: JobStatus


@dataclass(slots=True)
class VerifyResult:
    spec: JobSpec
    bounds: Bounds
    states: int = 0
    transitions: int = 0
    depth: int = 0
    max_seq: int = 0
    terminal_states: int = 0
    wall_s: float = 0.0
    complete: bool = True
    # True: holds; False: violated; None: not checked (a liveness property of a search the
    # state bound cut short: it looked VIOLATED, with no violation to show)
    verdicts: dict[str, bool | None] = field(default_factory=dict)
    violation: Violation | None = None

    @property
    def ok(self) -> bool:
        return (
            self.complete
            and self.violation is None
            and all(held is True for held in self.verdicts.values())
        )

    @property
    def states_per_s(self) -> float:
        return self.states / self.wall_s if self.wall_s > 0 else 0.0


def default_bounds(spec: JobSpec) -> Bounds:
    # Enough disruptions to exhaust the budget (max_retry + 1 counted faults) plus three more
    # that are not counted (in checks, while restarting) anywhere along the way.
    return Bounds(faults=spec.max_retry + 4, max_states=5_000_000)


def check(spec: JobSpec, bounds: Bounds | None = None, step: StepFn = machine.step) -> VerifyResult:
    bounds = bounds or default_bounds(spec)
    result = VerifyResult(spec=spec, bounds=bounds)
    result.verdicts = {name: True for name in (*inv.STATE_INVARIANTS, *inv.TRANSITION_INVARIANTS)}
    started = time.perf_counter()
    explorer = _Explorer(spec, bounds, step, result)
    explorer.run()
    if result.violation is None and result.complete:
        explorer.check_liveness()
    else:
        for name in LIVENESS:  # unchecked: an incomplete space, or a violation stopped it
            result.verdicts.setdefault(name, None)
    result.wall_s = time.perf_counter() - started
    return result


View = tuple[object, ...]


def view(status: JobStatus) -> View:
    """What the visited set remembers of a status: what steers the machine, up to symmetry.

    Three reductions, each sound because no decision of ``step`` reads what it drops:
    failure reasons, timestamps, node names and the error-node list are carried along but only
    copied, never branched on (TLC's VIEW); the master seq only matters relative to the seq a
    message carries, and the environment draws those relative to the current one, so absolute
    seqs fold away; and pods are interchangeable (the environment treats them alike), so the
    view is the multiset of pod states (symmetry reduction).
    """
    pods = sorted(
        (
            info.inner_phase.value,
            info.finished,
            info.retries,
            info.verdict.value if info.verdict else "",
            int(info.evict) if info.evict else 0,
            info.slow,
            info.drain,
        )
        for info in status.pod_infos.values()
    )
    return (
        status.phase.value,
        status.recover_count,
        status.should_quit,
        status.outstanding,
        status.away,
        status.slow_count,
        status.drain_count,
        tuple(pods),
    )


class _Explorer:
    def __init__(self, spec: JobSpec, bounds: Bounds, step: StepFn, result: VerifyResult) -> None:
        self.spec, self.bounds, self.step, self.result = spec, bounds, step, result
        self.ids: dict[tuple[View, int], int] = {}
        self.keys: list[tuple[JobStatus, int]] = []
        self.parent: list[int] = []
        self.via: list[ev.Event | None] = []
        self.coop: list[list[int]] = []

    def _add(
        self, key: tuple[View, int], parent: int, event: ev.Event | None, status: JobStatus
    ) -> int:
        sid = len(self.keys)
        self.ids[key] = sid
        self.keys.append((status, key[1]))
        self.parent.append(parent)
        self.via.append(event)
        self.coop.append([])
        return sid

    def run(self) -> None:
        nodes = [NodeName(f"node-{i}") for i in range(self.spec.worker_num)]
        root = (initial_status(self.spec, nodes), 0)
        if self._state_violation(root[0], 0, None):
            return
        self._add((view(root[0]), 0), -1, None, root[0])
        frontier: deque[tuple[int, int]] = deque([(0, 0)])
        result, spec, step = self.result, self.spec, self.step
        state_checks = tuple(inv.STATE_INVARIANTS.items())
        transition_checks = tuple(inv.TRANSITION_INVARIANTS.items())
        while frontier:
            sid, depth = frontier.popleft()
            status, spent = self.keys[sid]
            result.depth = max(result.depth, depth)
            result.max_seq = max(result.max_seq, status.seq)
            if status.phase in TERMINAL_PHASES:
                result.terminal_states += 1
            for move in environment.moves(status, faults_left=self.bounds.faults - spent):
                after, _ = step(spec, status, move.event, 0.0)
                result.transitions += 1
                if after is status or after == status:
                    continue
                for name, check_transition in transition_checks:
                    message = check_transition(spec, status, move.event, after)
                    if message is not None:
                        self._violate(name, message, sid, move.event, after)
                        return
                key = (view(after), spent + 1 if move.fault else spent)
                nid = self.ids.get(key)
                if nid is None:
                    for name, check_state in state_checks:
                        message = check_state(spec, after)
                        if message is not None:
                            self._violate(name, message, sid, move.event, after)
                            return
                    nid = self._add(key, sid, move.event, after)
                    frontier.append((nid, depth + 1))
                    if len(self.keys) >= self.bounds.max_states:
                        result.complete = False
                        result.states = len(self.keys)
                        return
                if move.cooperative:
                    self.coop[sid].append(nid)
        result.states = len(self.keys)

    def _state_violation(self, status: JobStatus, sid: int, event: ev.Event | None) -> bool:
        for name, check_state in inv.STATE_INVARIANTS.items():
            message = check_state(self.spec, status)
            if message is not None:
                self.result.violation = Violation(name, message, [], status)
                self.result.verdicts[name] = False
                return True
        return False

    def _violate(
        self, name: str, message: str, sid: int, event: ev.Event, after: JobStatus
    ) -> None:
        self.result.states = len(self.keys)
        self.result.verdicts[name] = False
        self.result.violation = Violation(name, message, [*self.trace(sid), event], after)

    def trace(self, sid: int) -> list[ev.Event]:
        events: list[ev.Event] = []
        while sid > 0:
            event = self.via[sid]
            assert event is not None
            events.append(event)
            sid = self.parent[sid]
        events.reverse()
        return events

    def check_liveness(self) -> None:
        """Dead ends, cooperative cycles and terminal reachability on the cooperative graph."""
        n = len(self.keys)
        terminal = [self.keys[i][0].phase in TERMINAL_PHASES for i in range(n)]
        verdicts = self.result.verdicts
        for sid in range(n):
            if not terminal[sid] and not self.coop[sid]:
                self._liveness_violation("NoDeadlock", "no cooperative move makes progress", sid)
                return
        verdicts["NoDeadlock"] = True
        cycle_at = self._find_cycle(terminal)
        if cycle_at is not None:
            self._liveness_violation(
                "FaultFreeTermination", "cooperative moves can cycle forever", cycle_at
            )
            return
        verdicts["FaultFreeTermination"] = True
        # Reverse reachability from the terminal states over cooperative edges.
        reverse: list[list[int]] = [[] for _ in range(n)]
        for sid, succ in enumerate(self.coop):
            for nid in succ:
                reverse[nid].append(sid)
        seen = list(terminal)
        queue = deque(i for i in range(n) if terminal[i])
        while queue:
            for pred in reverse[queue.popleft()]:
                if not seen[pred]:
                    seen[pred] = True
                    queue.append(pred)
        for sid in range(n):
            if not seen[sid]:
                self._liveness_violation("TerminalReachable", "no terminal phase reachable", sid)
                return
        verdicts["TerminalReachable"] = True

    def _find_cycle(self, terminal: list[bool]) -> int | None:
        """Kahn's algorithm on the cooperative graph of non-terminal states."""
        n = len(self.keys)
        indegree = [0] * n
        for sid in range(n):
            if terminal[sid]:
                continue
            for nid in self.coop[sid]:
                if not terminal[nid]:
                    indegree[nid] += 1
        queue = deque(i for i in range(n) if not terminal[i] and indegree[i] == 0)
        removed = 0
        while queue:
            sid = queue.popleft()
            removed += 1
            for nid in self.coop[sid]:
                if not terminal[nid]:
                    indegree[nid] -= 1
                    if indegree[nid] == 0:
                        queue.append(nid)
        non_terminal = n - sum(terminal)
        if removed == non_terminal:
            return None
        return next(i for i in range(n) if not terminal[i] and indegree[i] > 0)

    def _liveness_violation(self, name: str, message: str, sid: int) -> None:
        self.result.verdicts[name] = False
        status = self.keys[sid][0]
        self.result.violation = Violation(name, message, self.trace(sid), status)
