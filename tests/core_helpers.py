"""Small drivers for table tests of the core: build a job and push it through rounds."""

from __future__ import annotations

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus, NodeName, PodName, initial_status, pod_names
from aegis.core.phases import Phase
from aegis.core.recovery import Classification

HEALTHY = Classification.HEALTHY


class Driver:
    """Feeds events to ``step`` and keeps the last status and actions."""

    def __init__(self, workers: int = 3, max_retry: int = 2) -> None:
        self.spec = JobSpec(job="job", namespace="ns", worker_num=workers, max_retry=max_retry)
        nodes = [NodeName(f"node-{i}") for i in range(workers)]
        self.status: JobStatus = initial_status(self.spec, nodes)
        self.actions: tuple[act.Action, ...] = ()
        self.pods: tuple[PodName, ...] = pod_names(self.spec)
        self.now = 0.0

    def pod(self, rank: int) -> PodName:
        return self.pods[rank]

    def feed(self, event: ev.Event) -> tuple[act.Action, ...]:
        self.now += 1.0
        self.status, self.actions = machine.step(self.spec, self.status, event, self.now)
        return self.actions

    def ack_all(self) -> None:
        for pod in self.pods:
            self.feed(ev.PodAcked(pod))

    def answer_all(self, verdicts: dict[int, Classification] | None = None) -> None:
        """Every pod answers the current check round (healthy unless told otherwise)."""
        verdicts = verdicts or {}
        phase, seq = self.status.phase, self.status.seq
        for rank, pod in enumerate(self.pods):
            verdict = verdicts.get(rank, HEALTHY)
            self.feed(ev.ChecksReported(pod, phase, seq, verdict, verdict.value))

    def to_running(self) -> None:
        self.ack_all()
        self.answer_all()
        assert self.status.phase is Phase.RUN_COMMAND

    def error(self, rank: int, reason: str = "boom") -> tuple[act.Action, ...]:
        return self.feed(ev.PodErrored(self.pod(rank), self.status.phase, self.status.seq, reason))

    def finish(self, rank: int, code: int = 0) -> tuple[act.Action, ...]:
        return self.feed(ev.PodFinished(self.pod(rank), self.status.phase, self.status.seq, code))

    def retries(self) -> tuple[int, ...]:
        return tuple(self.status.pod_infos[p].retries for p in self.pods)

    def inner(self, rank: int) -> Phase:
        return self.status.pod_infos[self.pod(rank)].inner_phase


def orders(actions: tuple[act.Action, ...]) -> list[str]:
    return [a.order.value for a in actions if isinstance(a, act.SendOrder)]


def rejected(actions: tuple[act.Action, ...]) -> act.RejectReason | None:
    for action in actions:
        if isinstance(action, act.Rejected):
            return action.reason
    return None
