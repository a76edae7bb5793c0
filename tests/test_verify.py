"""The model checker: exhaustive over the production ``step``, and it catches mutants."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from aegis.cli import main as cli
from aegis.core import events as ev
from aegis.core import machine, resolution, rounds, updates
from aegis.core.model import JobSpec, JobStatus
from aegis.core.phases import Order, Phase
from aegis.core.recovery import must_leave
from aegis.tools.verify import checker


def test_verify_holds_exhaustively_for_3_workers_max_retry_2() -> None:
    spec = JobSpec("verify", "default", 3, 2)
    result = checker.check(spec)
    assert result.ok, result.violation
    assert result.complete
    assert result.states > 10_000  # the whole space, not a sample
    assert result.terminal_states > 0
    assert set(result.verdicts) >= {
        "ValidPhase",
        "ValidInnerPhase",
        "RecoverCountBound",
        "RetriesBound",
        "PhaseConsistency",
        "NoFinishDoubleProcessed",
        "MasterSeqNumMonotonic",
        "WorkerSeqNumBound",
        "StaleFinishRejected",
        "CountMatchesMax",
        "NoCountOutsideRunCommand",
        "TerminalAbsorbing",
        "NoDeadlock",
        "FaultFreeTermination",
        "TerminalReachable",
        "SuspectFirst",
        "AwayUntilBack",
        "NodeDownOnlyBlacklists",
    }


def test_verify_cli_prints_report_and_exits_0() -> None:
    code = cli.main(["verify", "--workers", "2", "--max-retry", "1"])
    assert code == 0


def test_verify_cli_json_has_counts_bounds_and_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["verify", "--workers", "2", "--max-retry", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True
    assert out["distinct_states"] > 0 and out["transitions"] > out["distinct_states"]
    assert out["bounds"]["faults"] == 5
    assert all(v == "ok" for v in out["invariants"].values())


def test_a_search_cut_short_proves_no_liveness_and_shows_no_violation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The state bound reached: the liveness properties were never checked. They printed
    VIOLATED, with no violation to show."""
    code = cli.main(["verify", "--workers", "2", "--max-retry", "1", "--max-states", "1",
                     "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["ok"] is False and out["violation"] is None
    liveness = ("NoDeadlock", "FaultFreeTermination", "TerminalReachable")
    assert {out["invariants"][name] for name in liveness} == {"unproven"}
    assert "VIOLATED" not in out["invariants"].values()


def test_verify_cli_rejects_bad_worker_count_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["verify", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "workers" in err[0]


# --- mutants: each breaks one rule of step; the checker must catch it with a trace ---------


def _wrap_step(mutate: Callable[..., tuple[JobStatus, tuple[object, ...]]]) -> checker.StepFn:
    return mutate  # type: ignore[return-value]


def _count_outside_run_command(spec, status, event, now):  # type: ignore[no-untyped-def]
    after, actions = machine.step(spec, status, event, now)
    if (
        status.phase is Phase.TROUBLESHOOTING
        and isinstance(event, ev.PodErrored)
        and after != status
    ):
        info = after.pod_infos[event.pod]
        import dataclasses

        bumped = dataclasses.replace(info, retries=info.retries + 1)
        after = dataclasses.replace(after, pod_infos=after.pod_infos.set(event.pod, bumped))
    return after, actions


MUTANTS: dict[str, tuple[ModuleType, str, object, set[str]]] = {
    "a node found down counts a fault": (
        rounds,
        "node_down",
        lambda status, node, reason, now: (
            updates.status(status, recover_count=status.recover_count + 1),
            (),
        ),
        {"NoCountOutsideRunCommand", "NodeDownOnlyBlacklists", "CountMatchesMax"},
    ),
    "drop the recover_count cap": (
        machine,
        "_capped_recover_count",
        lambda spec, status: status.recover_count + 1,
        {"RecoverCountBound", "CountMatchesMax"},
    ),
    "process a duplicate finish": (
        machine,
        "_already_finished",
        lambda info: False,
        {"NoFinishDoubleProcessed"},
    ),
    "accept a stale seq": (
        machine,
        "_is_current",
        lambda status, phase, seq: True,
        {"StaleFinishRejected"},
    ),
    "forget to align retries on return to RunCommand": (
        rounds,
        "align_retries",
        lambda status: status.pod_infos,
        {"CountMatchesMax"},
    ),
    "never leave Troubleshooting when a pod exits": (
        rounds,
        "evict",
        lambda status, leaving, now, phase: (status, ()),
        # (a software fault during a drain evicts too: retries left unaligned)
        # (a suspect that must leave then stays too)
        {
            "NoDeadlock",
            "CountersConsistent",
            "FaultFreeTermination",
            "CountMatchesMax",
            "SuspectFirst",
        },
    ),
    "terminal Failed not absorbing": (
        machine,
        "TERMINAL_PHASES",
        frozenset({Phase.SUCCEED}),
        {"TerminalAbsorbing"},
    ),
    "restart in place after a software fault past the budget": (
        machine,
        "_restart_in_place",
        lambda spec, status, now: rounds.start_round(
            updates.status(status, pod_infos=rounds.align_retries(status)),
            Phase.RUN_COMMAND,
            Order.RESTART,
            now,
        ),
        {"SpentBudgetStopsTraining"},
    ),
    "wait for every answer although the suspect must leave": (
        resolution,
        "concludes_early",
        lambda status, info, verdict: False,
        {"SuspectFirst"},
    ),
    "end a round on its suspect's answer while a pod is away": (
        resolution,
        "concludes_early",
        lambda status, info, verdict: (
            status.phase is Phase.TROUBLESHOOTING and info.slow and must_leave(verdict)
        ),
        {"AwayUntilBack"},
    ),
    "a pod not back in time taken for present": (
        rounds,
        "replace_elsewhere",
        lambda status, pod, info, reason, now: (
            updates.status(
                status, pod_infos=status.pod_infos.set(pod, updates.pod(info, finished=True))
            ),
            (),
        ),
        {"CountersConsistent"},
    ),
    "a pod not back in time counted again": (
        rounds,
        "replace_elsewhere",
        lambda status, pod, info, reason, now: (
            updates.status(
                status,
                recover_count=status.recover_count + 1,
                pod_infos=status.pod_infos.set(pod, updates.pod(info, retries=info.retries + 1)),
            ),
            (),
        ),
        {"NoCountOutsideRunCommand"},
    ),
    "budget exhausted without should_quit": (
        rounds,
        "fail",
        lambda spec, status, reason, now, budget_spent: rounds.end(
            updates.status(status, recover_count=spec.max_retry + 1), Phase.FAILED, reason, now
        ),
        {"FailedMeansShouldQuit"},
    ),
}


@pytest.fixture
def small_spec() -> Iterator[JobSpec]:
    yield JobSpec("mutant", "default", 2, 2)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checker_catches_mutant_with_a_trace(
    name: str, small_spec: JobSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, attribute, replacement, expected = MUTANTS[name]
    monkeypatch.setattr(module, attribute, replacement)
    result = checker.check(small_spec, checker.Bounds(faults=4, max_states=200_000))
    assert not result.ok
    assert result.violation is not None
    assert result.violation.invariant in expected, result.violation
    assert result.violation.trace, "a violation must come with the events that lead to it"


def test_checker_catches_mutant_counting_outside_run_command(small_spec: JobSpec) -> None:
    result = checker.check(
        small_spec, checker.Bounds(faults=4, max_states=200_000), step=_count_outside_run_command
    )
    assert result.violation is not None
    assert result.violation.invariant in {"NoCountOutsideRunCommand", "OneFaultCountsOnce"}
    trace = result.violation.trace
    assert any(isinstance(e, ev.PodErrored) for e in trace)


def test_violation_trace_replays_to_the_violating_status(
    small_spec: JobSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        machine, "_capped_recover_count", lambda spec, status: status.recover_count + 1
    )
    result = checker.check(small_spec, checker.Bounds(faults=4, max_states=200_000))
    assert result.violation is not None
    from aegis.core.model import NodeName, initial_status

    status = initial_status(small_spec, [NodeName("node-0"), NodeName("node-1")])
    for event in result.violation.trace:
        status, _ = machine.step(small_spec, status, event, 0.0)
    assert status.recover_count == small_spec.max_retry + 1
    assert status.phase is not Phase.FAILED


def test_verify_cli_exits_1_and_prints_trace_on_violation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(machine, "_is_current", lambda status, phase, seq: True)
    code = cli.main(["verify", "--workers", "2", "--max-retry", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "VIOLATED StaleFinishRejected" in out and "shortest trace" in out
