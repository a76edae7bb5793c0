"""Property tests: random event sequences through ``step`` for worker counts the exhaustive run
cannot cover, checking the same invariants as ``aegis verify`` after every event."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aegis.core import events as ev
from aegis.core import invariants as inv
from aegis.core import machine
from aegis.core.model import JobSpec, JobStatus, NodeName, initial_status, pod_names
from aegis.core.phases import Phase
from aegis.core.recovery import Classification

VERDICTS = st.sampled_from(list(Classification))
SEQ_OFFSETS = st.sampled_from([-1, 0, 0, 0, 1])


class JobMachine(RuleBasedStateMachine):
    spec: JobSpec
    status: JobStatus

    @initialize(workers=st.integers(1, 12), max_retry=st.integers(0, 4))
    def create(self, workers: int, max_retry: int) -> None:
        self.spec = JobSpec("prop", "default", workers, max_retry)
        self.pods = pod_names(self.spec)
        nodes = [NodeName(f"node-{i}") for i in range(workers)]
        self.status = initial_status(self.spec, nodes)
        self.now = 0.0
        self.counted = 0

    def _feed(self, event: ev.Event) -> None:
        self.now += 1.0
        before = self.status
        after, actions = machine.step(self.spec, before, event, self.now)
        for name, check in inv.TRANSITION_INVARIANTS.items():
            message = check(self.spec, before, event, after)
            assert message is None, f"{name}: {message}"
        if after is before:
            assert len(actions) == 1  # exactly one Rejected action says why
        self.status = after

    def _pod(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(self.pods))

    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        self._feed(ev.PodAcked(self._pod(data)))  # type: ignore[arg-type]

    @rule(data=st.data(), verdict=VERDICTS, offset=SEQ_OFFSETS)
    def answer_checks(self, data: st.DataObject, verdict: Classification, offset: int) -> None:
        pod = self._pod(data)
        s = self.status
        self._feed(ev.ChecksReported(pod, s.phase, s.seq + offset, verdict))  # type: ignore[arg-type]

    @rule(data=st.data(), code=st.sampled_from([0, 0, 0, 1, 137]), offset=SEQ_OFFSETS)
    def finish(self, data: st.DataObject, code: int, offset: int) -> None:
        s = self.status
        self._feed(ev.PodFinished(self._pod(data), s.phase, s.seq + offset, code))  # type: ignore[arg-type]

    @rule(data=st.data(), offset=SEQ_OFFSETS)
    def error(self, data: st.DataObject, offset: int) -> None:
        s = self.status
        self._feed(ev.PodErrored(self._pod(data), s.phase, s.seq + offset, "boom"))  # type: ignore[arg-type]

    @rule(data=st.data())
    def hang(self, data: st.DataObject) -> None:
        s = self.status
        self._feed(ev.HangReported(self._pod(data), s.phase, s.seq))  # type: ignore[arg-type]

    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        self._feed(ev.HeartbeatLost(self._pod(data)))  # type: ignore[arg-type]

    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        self._feed(ev.PodRestarted(self._pod(data)))  # type: ignore[arg-type]

    @rule()
    def checkpoint(self) -> None:
        self._feed(ev.CheckpointCommitted(step=1))

    @rule()
    def drive_to_progress(self) -> None:
        """What a healthy cluster does next: the cooperative move for every pod."""
        s = self.status
        for pod, info in s.pod_infos.items():
            if info.inner_phase is Phase.RESTARTING and not info.finished:
                self._feed(ev.PodRestarted(pod))
            elif info.inner_phase is Phase.PENDING and not info.finished:
                self._feed(ev.PodAcked(pod))
            elif s.phase in (Phase.BOOT_CHECKING, Phase.TROUBLESHOOTING) and not info.finished:
                self._feed(ev.ChecksReported(pod, s.phase, s.seq, Classification.HEALTHY))
            elif s.phase is Phase.RUN_COMMAND and not info.finished:
                self._feed(ev.PodFinished(pod, s.phase, s.seq, 0))
            s = self.status

    @invariant()
    def state_invariants_hold(self) -> None:
        if not hasattr(self, "status"):
            return
        for name, check in inv.STATE_INVARIANTS.items():
            message = check(self.spec, self.status)
            assert message is None, f"{name}: {message}"


# On the suite's profile (tests/conftest.py: no deadline, no health check that times anything).
JobMachine.TestCase.settings = settings(
    settings.get_profile("aegis"), max_examples=150, stateful_step_count=60
)
TestJobMachine = JobMachine.TestCase


def test_fault_free_run_reaches_succeed_for_many_workers() -> None:
    """With no faults, a 200-pod job goes Pending -> BootChecking -> RunCommand -> Succeed."""
    spec = JobSpec("big", "default", 200, 3)
    status = initial_status(spec)
    phases = [status.phase]
    for pod in pod_names(spec):
        status, _ = machine.step(spec, status, ev.PodAcked(pod), 0.0)
    phases.append(status.phase)
    for pod in pod_names(spec):
        event = ev.ChecksReported(pod, status.phase, status.seq, Classification.HEALTHY)
        status, _ = machine.step(spec, status, event, 0.0)
    phases.append(status.phase)
    for pod in pod_names(spec):
        status, _ = machine.step(
            spec, status, ev.PodFinished(pod, status.phase, status.seq, 0), 0.0
        )
    phases.append(status.phase)
    assert phases == [Phase.PENDING, Phase.BOOT_CHECKING, Phase.RUN_COMMAND, Phase.SUCCEED]


def test_status_json_round_trips_every_reachable_state_of_a_small_job() -> None:
    """What the master writes to the store reads back as the same status (takeover relies
    on it): checked on every state the model checker reaches for 2 workers."""
    from aegis.tools.verify import checker
    from aegis.wire import status_json

    spec = JobSpec("rt", "default", 2, 1)
    explorer = checker._Explorer(
        spec,
        checker.Bounds(faults=3, max_states=100_000),
        machine.step,
        checker.VerifyResult(spec=spec, bounds=checker.default_bounds(spec)),
    )
    explorer.run()
    assert len(explorer.keys) > 100
    for status, _ in explorer.keys:
        assert status_json.from_dict(status_json.to_dict(spec, status)) == (spec, status)
