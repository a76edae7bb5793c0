"""Feeds the real ``aegis.core.machine.step`` every pod's events for each simulated fault.

The simulation decides *when* things happen; the core decides *what* happens: whether a fault is
counted, which recovery level it gets, whether the job has spent its fault budget (``max_retry``)
and Failed. Per fault the driver feeds the agent's report (Error, Hang or a lost heartbeat), one
troubleshoot answer from every pod, and for pods that must leave the replacement's restart, ACK and
a second round of answers: about two to three events per pod, the real load on a master.

The driver feeds a whole recovery at the moment the fault is detected (the core is instant; the
engine charges the durations), so the core is back in RunCommand before the next fault arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.errors import AegisError
from aegis.core.model import JobSpec, JobStatus, NodeName, PodName, initial_status, pod_names
from aegis.core.phases import CHECK_PHASES, Phase
from aegis.core.recovery import Classification, RecoveryLevel
from aegis.tools.simulate.faults import FaultKind


class SimulationError(AegisError, RuntimeError):
    """The driver fed the core an event it rejected: a bug in the driver (or in the core)."""


@dataclass(frozen=True, slots=True)
class CoreOutcome:
    level: RecoveryLevel  # the most disruptive level the core chose
    rounds: int  # troubleshoot rounds run (each costs one round of checks)
    replaced: int  # pods that left and came back (replacement or container restart)
    failed: bool  # the fault budget was spent: the job is Failed


# What a pod's checks say after a fault of each kind (the failing pod; every other pod passes).
VERDICT_BY_KIND: dict[FaultKind, Classification] = {
    FaultKind.CRASH_RESTART: Classification.HEALTHY,
    FaultKind.CRASH_CONTAINER: Classification.RUNTIME,
    FaultKind.CRASH_REPLACE: Classification.HARDWARE,
    FaultKind.HANG_RESTART: Classification.HEALTHY,
    FaultKind.HANG_REPLACE: Classification.HARDWARE,
    FaultKind.SLOW: Classification.SLOW,
    FaultKind.NODE_LOST: Classification.HEALTHY,
}


class CoreDriver:
    """Holds one job's spec and status; every change goes through ``machine.step``."""

    __slots__ = ("_pods", "_spare", "_spec", "_status", "steps")

    def __init__(self, spec: JobSpec, now: float = 0.0) -> None:
        self._spec = spec
        self._pods = pod_names(spec)
        self._spare = 0
        self.steps = 0
        nodes = [NodeName(f"node-{rank}") for rank in range(spec.worker_num)]
        self._status = initial_status(spec, nodes, now=now)
        for pod in self._pods:
            self._feed(ev.PodAcked(pod=pod), now)
        self._answer_round({}, now)
        if self._status.phase is not Phase.RUN_COMMAND:
            raise SimulationError(f"bootcheck ended in {self._status.phase}")

    @property
    def status(self) -> JobStatus:
        return self._status

    @property
    def spec(self) -> JobSpec:
        return self._spec

    def fault(self, kind: FaultKind, rank: int, now: float) -> CoreOutcome:
        """One fault of pod ``rank`` while training runs; recover until RunCommand (or Failed)."""
        self._require(Phase.RUN_COMMAND)
        pod = self._pods[rank]
        seq = self._status.seq
        first: ev.Event
        match kind:
            case FaultKind.NODE_LOST:
                first = ev.HeartbeatLost(pod=pod)
            case FaultKind.HANG_RESTART | FaultKind.HANG_REPLACE | FaultKind.SLOW:
                first = ev.HangReported(pod=pod, phase=Phase.RUN_COMMAND, seq=seq, reason=kind)
            case _:
                first = ev.PodErrored(pod=pod, phase=Phase.RUN_COMMAND, seq=seq, reason=kind)
        actions = self._feed(first, now)
        return self._recover(actions, {pod: VERDICT_BY_KIND[kind]}, now)

    def checkpoint(self, step: int, now: float) -> CoreOutcome | None:
        """A committed checkpoint: the safe point where pods marked slow are evicted."""
        if self._status.phase is not Phase.RUN_COMMAND or self._status.slow_count == 0:
            return None
        actions = self._feed(ev.CheckpointCommitted(step=step), now)
        return self._recover(actions, {}, now)

    def finish(self, now: float) -> Phase:
        """The run is over: every pod's training exits 0."""
        self._require(Phase.RUN_COMMAND)
        seq = self._status.seq
        for pod in self._pods:
            self._feed(ev.PodFinished(pod=pod, phase=Phase.RUN_COMMAND, seq=seq, exit_code=0), now)
        return self._status.phase

    def _recover(
        self, actions: tuple[act.Action, ...], verdicts: dict[PodName, Classification], now: float
    ) -> CoreOutcome:
        level = RecoveryLevel.IN_PLACE
        rounds = 0
        replaced = 0
        while True:
            leaving: list[PodName] = []
            for action in actions:
                match action:
                    case act.EvictPod(pod=pod, level=evict_level):
                        leaving.append(pod)
                        level = max(level, evict_level)
                    case act.ReplacePod(pod=pod):
                        leaving.append(pod)
                        level = max(level, RecoveryLevel.NODE)
                    case act.Rejected(reason=reason, detail=detail):
                        raise SimulationError(f"core rejected an event: {reason} {detail}")
                    case _:
                        pass
            phase = self._status.phase
            if phase is Phase.FAILED:
                return CoreOutcome(level=level, rounds=rounds, replaced=replaced, failed=True)
            if phase is Phase.RUN_COMMAND:
                return CoreOutcome(level=level, rounds=rounds, replaced=replaced, failed=False)
            if leaving:
                actions = self._bring_back(leaving, now)
                replaced += len(leaving)
            elif phase in CHECK_PHASES:
                actions = self._answer_round(verdicts, now)
                verdicts = {}  # a replacement (or a second round) finds the nodes healthy
                rounds += 1
            else:
                raise SimulationError(f"stuck in {phase} with no pod to bring back")

    def _bring_back(self, leaving: list[PodName], now: float) -> tuple[act.Action, ...]:
        """Each leaving pod's replacement starts on a spare node and ACKs."""
        actions: tuple[act.Action, ...] = ()
        for pod in leaving:
            self._spare += 1
            node = NodeName(f"spare-{self._spare}")
            self._feed(ev.PodRestarted(pod=pod, node=node, pod_ip=""), now)
            actions = self._feed(ev.PodAcked(pod=pod), now)
        return actions

    def _answer_round(
        self, verdicts: dict[PodName, Classification], now: float
    ) -> tuple[act.Action, ...]:
        """Every pod answers the current check round, a suspect first (a pod marked slow or
        hung: its node is checked first); the last answer resolves it, or the suspect's own
        when it must leave (the others' would then be stale: they are not sent)."""
        status = self._status
        phase, seq = status.phase, status.seq
        spec, healthy = self._spec, Classification.HEALTHY
        actions: tuple[act.Action, ...] = ()
        answered = 0
        for pod in sorted(self._pods, key=lambda p: not status.pod_infos[p].slow):
            if (status.phase, status.seq) != (phase, seq):
                break  # the round ended on a suspect's answer
            answered += 1
            verdict = verdicts.get(pod, healthy)
            reason = "" if verdict is healthy else verdict.value
            answer = ev.ChecksReported(
                pod=pod, phase=phase, seq=seq, verdict=verdict, reason=reason
            )
            status, actions = machine.step(spec, status, answer, now)
            if actions and isinstance(actions[0], act.Rejected):
                raise SimulationError(f"core rejected {answer}: {actions[0]}")
        self.steps += answered
        self._status = status
        return actions

    def _feed(self, event: ev.Event, now: float) -> tuple[act.Action, ...]:
        self._status, actions = machine.step(self._spec, self._status, event, now)
        self.steps += 1
        return actions

    def _require(self, phase: Phase) -> None:
        if self._status.phase is not phase:
            raise SimulationError(f"expected {phase}, the job is {self._status.phase}")
