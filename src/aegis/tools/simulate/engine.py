"""The timeline: a discrete-event simulation of one synchronous job over a horizon of wall time.

The job computes; every ``ckpt_interval_s`` of compute it pauses ``ckpt_cost_s`` to save a
checkpoint (Young's and Daly's model). A fault stops it: the time until detection, the recovery,
and the compute since the checkpoint it resumes from are lost. A fault during a save loses that
save; a fault during a recovery starts the recovery over. Under the Aegis policy every fault (and
every committed checkpoint) goes through the real core, which decides the recovery level and
whether the job Failed (then it is resubmitted and the failure reported).

Wall time = useful + checkpoint + detection + recovery + rollback, exactly, at the end.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from aegis.core.model import JobSpec
from aegis.tools.simulate import faults as flt
from aegis.tools.simulate import recovery_costs as rc
from aegis.tools.simulate.core_driver import CoreDriver
from aegis.tools.simulate.events import EventKind, EventQueue, SimEvent
from aegis.tools.simulate.settings import SimSettings


@dataclass(frozen=True, slots=True)
class SimSpec:
    gpus: int = 16_384
    gpus_per_node: int = 8
    days: float = 54.0
    trace: flt.TraceKind = flt.TraceKind.LLAMA3
    mtbf_s: float | None = None
    ckpt_interval_s: float = 1800.0
    ckpt_cost_s: float = 30.0
    policy: rc.Policy = rc.Policy.AEGIS
    seed: int = 0
    max_retry: int = 10_000
    settings: SimSettings = field(default_factory=SimSettings)

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def horizon_s(self) -> float:
        return self.days * flt.DAY_S

    def trace_spec(self) -> flt.TraceSpec:
        return flt.TraceSpec(self.trace, self.nodes, self.horizon_s, self.mtbf_s)


class Mode(enum.Enum):
    RUNNING = "running"
    SAVING = "saving"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class SimResult:
    spec: SimSpec
    useful_s: float
    lost_s: dict[str, float]  # detection, recovery, rollback, checkpoint
    faults: int
    by_level: dict[str, int]  # recovery level -> interruptions (slow evictions included)
    by_cause: dict[str, int]
    failures: int  # times the real core declared the job Failed (fault budget spent)
    first_failure_s: float | None
    core_steps: int

    @property
    def ratio(self) -> float:
        return self.useful_s / self.spec.horizon_s


@dataclass(slots=True)
class _Timeline:
    """Mutable state of one run; owned by ``run`` and never shared."""

    mode: Mode = Mode.RUNNING
    now: float = 0.0
    generation: int = 0
    progress: float = 0.0  # compute seconds kept so far
    saved: float = 0.0  # progress held by the newest finished save
    durable: float = 0.0  # progress held by the newest checkpoint committed to disk
    down_detect_left: float = 0.0
    lost: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("detection", "recovery", "rollback", "checkpoint"), 0.0
        )
    )

    def advance(self, t: float) -> None:
        dt = t - self.now
        self.now = t
        if self.mode is Mode.RUNNING:
            self.progress += dt
        elif self.mode is Mode.SAVING:
            self.lost["checkpoint"] += dt
        else:
            detect = min(dt, self.down_detect_left)
            self.down_detect_left -= detect
            self.lost["detection"] += detect
            self.lost["recovery"] += dt - detect


def run(spec: SimSpec) -> SimResult:
    """Simulate ``spec``; a pure function of it (the seed included)."""
    trace = flt.generate(spec.trace_spec(), random.Random(spec.seed))
    sim = _Run(spec)
    for fault in trace:
        sim.queue.push(SimEvent(fault.time_s, EventKind.FAULT, fault=fault))
    sim.queue.push(SimEvent(spec.horizon_s, EventKind.END))
    sim.queue.push(SimEvent(spec.ckpt_interval_s, EventKind.SAVE_START))
    while True:
        event = sim.queue.pop()
        sim.tl.advance(event.time_s)
        if event.kind is EventKind.END:
            break
        sim.handle(event)
    return sim.finish(len(trace))


class _Run:
    """One run's mutable state and handlers; created and consumed by ``run``."""

    __slots__ = (
        "by_cause",
        "by_level",
        "driver",
        "failures",
        "first_failure",
        "job",
        "queue",
        "spec",
        "steps",
        "tl",
    )

    def __init__(self, spec: SimSpec) -> None:
        self.spec = spec
        self.queue = EventQueue()
        self.tl = _Timeline()
        self.job = JobSpec(
            job="sim", namespace="default", worker_num=spec.nodes, max_retry=spec.max_retry
        )
        self.driver = CoreDriver(self.job) if spec.policy is rc.Policy.AEGIS else None
        self.steps = 0
        self.by_level: dict[str, int] = {}
        self.by_cause: dict[str, int] = {}
        self.failures = 0
        self.first_failure: float | None = None

    def handle(self, event: SimEvent) -> None:
        tl = self.tl
        match event.kind:
            case EventKind.FAULT:
                assert event.fault is not None
                self._on_fault(event.fault)
            case EventKind.SAVE_START if event.generation == tl.generation:
                tl.mode = Mode.SAVING
                self._schedule(tl.now + self.spec.ckpt_cost_s, EventKind.SAVE_DONE)
            case EventKind.SAVE_DONE if event.generation == tl.generation:
                self._on_save_done()
            case EventKind.COMMIT:
                self._on_commit(event.progress_s)
            case EventKind.RESUME if event.generation == tl.generation:
                tl.mode = Mode.RUNNING
                self._schedule(tl.now + self.spec.ckpt_interval_s, EventKind.SAVE_START)
            case _:
                pass  # stale: the job was interrupted after this was scheduled

    def _schedule(self, time_s: float, kind: EventKind) -> None:
        self.queue.push(SimEvent(time_s, kind, generation=self.tl.generation))

    def _on_fault(self, fault: flt.Fault) -> None:
        self.by_cause[fault.cause.name] = self.by_cause.get(fault.cause.name, 0) + 1
        if self.driver is None:
            self._count("job relaunch")
            self._interrupt(rc.baseline_cost(self.spec.settings.baseline))
            return
        outcome = self.driver.fault(fault.cause.kind, fault.node, self.tl.now)
        self._count(outcome.level.name)
        if outcome.failed:
            self.failures += 1
            if self.first_failure is None:
                self.first_failure = self.tl.now
            self.steps += self.driver.steps
            self.driver = CoreDriver(self.job, self.tl.now)  # resubmitted with a fresh budget
        self._interrupt(rc.aegis_cost(fault.cause.kind, outcome, self.spec.settings.aegis))

    def _on_save_done(self) -> None:
        tl = self.tl
        tl.mode = Mode.RUNNING
        tl.saved = tl.progress
        if self.driver is None:
            tl.durable = tl.progress  # the baseline saves straight to durable storage
        else:
            commit = tl.now + self.spec.settings.aegis.persist_s
            self.queue.push(SimEvent(commit, EventKind.COMMIT, progress_s=tl.progress))
        self._schedule(tl.now + self.spec.ckpt_interval_s, EventKind.SAVE_START)

    def _on_commit(self, progress_s: float) -> None:
        # Persisting runs in the background and survives the job's interruptions; a checkpoint
        # newer than a rollback's target no longer exists in the job's history.
        tl = self.tl
        if progress_s <= tl.progress:
            tl.durable = max(tl.durable, progress_s)
        if self.driver is None or tl.mode is Mode.DOWN:
            return
        evicted = self.driver.checkpoint(int(progress_s), tl.now)
        if evicted is not None:
            self._count(evicted.level.name)
            self._interrupt(rc.aegis_cost(None, evicted, self.spec.settings.aegis))

    def _count(self, level: str) -> None:
        self.by_level[level] = self.by_level.get(level, 0) + 1

    def _interrupt(self, cost: rc.Cost) -> None:
        """Training stops now; it resumes after detection + recovery from the chosen checkpoint.
        Interrupted while down, the recovery starts over (nothing more to roll back)."""
        tl = self.tl
        if tl.mode is not Mode.DOWN:
            target = tl.saved if cost.rollback is rc.Rollback.MEMORY else tl.durable
            target = min(target, tl.progress)
            tl.lost["rollback"] += tl.progress - target
            tl.progress = target
        tl.mode = Mode.DOWN
        tl.generation += 1
        tl.down_detect_left = cost.detection_s
        self._schedule(tl.now + cost.detection_s + cost.recovery_s, EventKind.RESUME)

    def finish(self, faults: int) -> SimResult:
        if self.driver is not None:
            self.driver.finish(self.tl.now)
            self.steps += self.driver.steps
        return SimResult(
            spec=self.spec,
            useful_s=self.tl.progress,
            lost_s=dict(self.tl.lost),
            faults=faults,
            by_level=self.by_level,
            by_cause=self.by_cause,
            failures=self.failures,
            first_failure_s=self.first_failure,
            core_steps=self.steps,
        )
