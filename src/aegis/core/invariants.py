"""The safety properties of DESIGN section 3, as pure predicates.

State invariants look at one status; transition invariants at (before, event, after). The model
checker (``aegis verify``) evaluates all of them on every reachable state and transition; the
property tests evaluate them along random runs. Each returns ``None`` when it holds, else a
one-line explanation.
"""

from __future__ import annotations

from collections.abc import Callable

from aegis.core import events as ev
from aegis.core import updates
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import ALLOWED_UNFINISHED_INNER, TERMINAL_PHASES, Phase
from aegis.core.recovery import must_leave

StateInvariant = Callable[[JobSpec, JobStatus], str | None]
TransitionInvariant = Callable[[JobSpec, JobStatus, ev.Event, JobStatus], str | None]

_PHASES = frozenset(Phase)


def valid_phase(spec: JobSpec, s: JobStatus) -> str | None:
    return None if s.phase in _PHASES else f"unknown phase {s.phase!r}"


def valid_inner_phase(spec: JobSpec, s: JobStatus) -> str | None:
    for pod, info in s.pod_infos.items():
        if info.inner_phase not in _PHASES:
            return f"{pod} has unknown inner phase {info.inner_phase!r}"
    return None


def recover_count_bound(spec: JobSpec, s: JobStatus) -> str | None:
    if 0 <= s.recover_count <= spec.max_retry + 1:
        return None
    return f"recover_count {s.recover_count} outside [0, {spec.max_retry + 1}]"


def retries_bound(spec: JobSpec, s: JobStatus) -> str | None:
    for pod, info in s.pod_infos.items():
        if not 0 <= info.retries <= spec.max_retry + 1:
            return f"{pod} retries {info.retries} outside [0, {spec.max_retry + 1}]"
    return None


def phase_consistency(spec: JobSpec, s: JobStatus) -> str | None:
    allowed = ALLOWED_UNFINISHED_INNER[s.phase]
    for pod, info in s.pod_infos.items():
        if s.phase in TERMINAL_PHASES:
            if info.inner_phase is not s.phase:
                return f"job {s.phase} but {pod} is {info.inner_phase}"
        elif not info.finished and info.inner_phase not in allowed:
            return f"job {s.phase} but unfinished {pod} is {info.inner_phase}"
    return None


def worker_seq_bound(spec: JobSpec, s: JobStatus) -> str | None:
    for pod, info in s.pod_infos.items():
        if info.seq > s.seq:
            return f"{pod} answered seq {info.seq} beyond the master's {s.seq}"
    return None


def count_matches_max(spec: JobSpec, s: JobStatus) -> str | None:
    if s.phase is Phase.FAILED:
        return None
    expected = min(max(info.retries for info in s.pod_infos.values()), spec.max_retry)
    if s.recover_count == expected:
        return None
    return f"recover_count {s.recover_count} != min(max retries, max_retry) = {expected}"


def counters_consistent(spec: JobSpec, s: JobStatus) -> str | None:
    """Our own: the round counters kept beside the pod map agree with the map."""
    unfinished = sum(1 for info in s.pod_infos.values() if not info.finished)
    if s.outstanding != unfinished:
        return f"outstanding {s.outstanding} != {unfinished} unfinished pods"
    if s.phase is not Phase.PENDING:
        away = sum(
            1
            for info in s.pod_infos.values()
            if not info.finished and info.inner_phase in (Phase.PENDING, Phase.RESTARTING)
        )
        if s.away != away:
            return f"away {s.away} != {away} pods away"
    slow = sum(1 for info in s.pod_infos.values() if info.slow)
    if s.slow_count != slow:
        return f"slow_count {s.slow_count} != {slow} pods marked slow"
    drain = sum(1 for info in s.pod_infos.values() if info.drain)
    if s.drain_count != drain:
        return f"drain_count {s.drain_count} != {drain} pods marked for a drain"
    return None


def failed_means_quit(spec: JobSpec, s: JobStatus) -> str | None:
    if s.phase is Phase.FAILED and not s.should_quit:
        return "Failed without should_quit"
    return None


def suspect_first(spec: JobSpec, s: JobStatus) -> str | None:
    """Our own (issue 18): the suspect's node is checked first. No troubleshooting round goes on
    waiting for other pods once a suspect (a pod marked slow or hung) answered that it must
    leave (unless a pod is away: the round waits for it)."""
    if s.phase is not Phase.TROUBLESHOOTING or s.away > 0:
        return None
    for pod, info in s.pod_infos.items():
        if info.slow and info.finished and info.verdict is not None and must_leave(info.verdict):
            return f"suspect {pod} must leave ({info.verdict}) and the round still waits"
    return None


STATE_INVARIANTS: dict[str, StateInvariant] = {
    "ValidPhase": valid_phase,
    "ValidInnerPhase": valid_inner_phase,
    "RecoverCountBound": recover_count_bound,
    "RetriesBound": retries_bound,
    "PhaseConsistency": phase_consistency,
    "WorkerSeqNumBound": worker_seq_bound,
    "CountMatchesMax": count_matches_max,
    "CountersConsistent": counters_consistent,
    "FailedMeansShouldQuit": failed_means_quit,
    "SuspectFirst": suspect_first,
}


def _ignored_changes_nothing(
    ignored: Callable[[JobStatus, ev.RoundMessage], bool],
    explain: Callable[[ev.RoundMessage], str],
) -> TransitionInvariant:
    """The invariant that a round message the master must ignore (``ignored``) leaves the
    status as it was; ``explain`` says what changed it."""

    def invariant(
        spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
    ) -> str | None:
        if isinstance(event, ev.RoundMessage) and ignored(before, event) and after != before:
            return explain(event)
        return None

    return invariant


def master_seq_monotonic(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    if after.seq < before.seq:
        return f"master seq went back from {before.seq} to {after.seq}"
    return None


def _answered_already(before: JobStatus, msg: ev.RoundMessage) -> bool:
    info = before.pod_infos.get(msg.pod)
    return info is not None and info.finished and msg.seq == before.seq


def _of_another_round(before: JobStatus, msg: ev.RoundMessage) -> bool:
    return msg.seq != before.seq or msg.phase != before.phase


# An answer from a pod that already answered this round changes nothing.
no_finish_double_processed = _ignored_changes_nothing(
    _answered_already, lambda m: f"second answer of {m.pod} in round {m.seq} changed the status"
)
# A message of another round (phase or seq) never changes anything.
stale_finish_rejected = _ignored_changes_nothing(
    _of_another_round, lambda m: f"stale {type(m).__name__} ({m.phase}/{m.seq}) changed the status"
)


def no_count_outside_run_command(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Outside RunCommand no fault is counted: recover_count stays, and a pod's retries only
    move to recover_count (the alignment on the way back to RunCommand)."""
    if before.phase is Phase.RUN_COMMAND or after.phase is Phase.FAILED:
        return None
    if after.recover_count != before.recover_count:
        return f"recover_count {before.recover_count}->{after.recover_count} in {before.phase}"
    for pod, info in after.pod_infos.items():
        old = before.pod_infos[pod].retries
        if info.retries not in (old, after.recover_count):
            return f"{pod} retries {old}->{info.retries} in {before.phase}"
    return None


def terminal_absorbing(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    if before.phase in TERMINAL_PHASES and after != before:
        return f"{type(event).__name__} changed a {before.phase} job"
    return None


def one_fault_counts_once(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Our own: one event adds at most one to the retries of at most one pod, beyond the
    alignment to recover_count of a round that (re)starts training (after a troubleshooting
    round, or at once after a software fault)."""
    aligning = before.phase is not Phase.RUN_COMMAND or (
        after.phase is Phase.RUN_COMMAND and after.seq != before.seq
    )
    added = sum(
        max(0, info.retries - before.pod_infos[pod].retries)
        for pod, info in after.pod_infos.items()
        if not (aligning and info.retries == after.recover_count)
    )
    if added > 1:
        return f"{type(event).__name__} added {added} to retries"
    return None


def planned_never_counts(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Our own: a drain, its deadline, a committed checkpoint and a slowdown are not faults:
    they never spend fault budget (retries and recover_count stay)."""
    planned = ev.DrainRequested | ev.DrainForced | ev.CheckpointCommitted | ev.SlowdownReported
    if not isinstance(event, planned):
        return None
    if after.recover_count != before.recover_count:
        return f"{type(event).__name__} moved recover_count"
    for pod, info in after.pod_infos.items():
        if info.retries != before.pod_infos[pod].retries:
            return f"{type(event).__name__} moved the retries of {pod}"
    return None


def spent_budget_stops_training(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Our own: a fault counted when the budget is already spent (recover_count at max_retry)
    never leads straight back to training; the job fails (at once, or when the round ends)."""
    if before.phase is not Phase.RUN_COMMAND or before.recover_count < spec.max_retry:
        return None
    if not _is_fault(event) or after == before:  # not a fault, or rejected
        return None
    if after.phase is Phase.RUN_COMMAND:
        return f"{type(event).__name__} over the budget restarted training"
    return None


def _is_fault(event: ev.Event) -> bool:
    match event:
        case ev.PodFinished(exit_code=code):
            return code != 0
        case ev.PodErrored() | ev.HangReported() | ev.HeartbeatLost() | ev.PodRestarted():
            return True
        case _:
            return False


def node_down_only_blacklists(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Our own: a node found down joins ErrorNodes and nothing else changes: the loss of its
    pod was counted, and handled, already."""
    if (
        isinstance(event, ev.NodeDown)
        and updates.status(after, error_nodes=before.error_nodes) != before
    ):
        return f"NodeDown({event.node}) changed more than ErrorNodes"
    return None


def away_until_back(
    spec: JobSpec, before: JobStatus, event: ev.Event, after: JobStatus
) -> str | None:
    """Our own: a pod that is away (lost, or leaving and awaiting its replacement) is present
    again only when it ACKs (or the job ends): no round may count it as there."""
    if before.phase is Phase.PENDING or after.phase in TERMINAL_PHASES:
        return None
    for pod, info in before.pod_infos.items():
        away = not info.finished and info.inner_phase in (Phase.PENDING, Phase.RESTARTING)
        acked = isinstance(event, ev.PodAcked) and event.pod == pod
        if away and after.pod_infos[pod].finished and not acked:
            return f"{type(event).__name__} counted away pod {pod} as present"
    return None


TRANSITION_INVARIANTS: dict[str, TransitionInvariant] = {
    "NoFinishDoubleProcessed": no_finish_double_processed,
    "MasterSeqNumMonotonic": master_seq_monotonic,
    "StaleFinishRejected": stale_finish_rejected,
    "NoCountOutsideRunCommand": no_count_outside_run_command,
    "TerminalAbsorbing": terminal_absorbing,
    "OneFaultCountsOnce": one_fault_counts_once,
    "PlannedNeverCounts": planned_never_counts,
    "SpentBudgetStopsTraining": spent_budget_stops_training,
    "AwayUntilBack": away_until_back,
    "NodeDownOnlyBlacklists": node_down_only_blacklists,
}
