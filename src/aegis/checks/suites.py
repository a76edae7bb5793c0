"""Which checks run in which round: bootcheck and troubleshoot (DESIGN section 6).

Bootcheck = the environment report (the runtime check's result line, see
:mod:`aegis.checks.env`) + allreduce_connect; troubleshoot = every check. The collective checks
run only when ``settings.group`` says where the pods meet. Within a round the checks that need
torch (runtime and the collectives) are answered by one child
(:class:`aegis.checks.group.CheckChildRound`: one torch import, or none when the agent's warm
check interpreter forks it, and one process group on ``master_port``); a warm one is forked at
the beginning of the round so that its rendezvous overlaps the local checks. Each check keeps its
own result, duration and budget.
"""

from __future__ import annotations

from aegis.checks import gpu, group, local, rdma
from aegis.checks.base import CheckFn, CheckSettings, Outcome, run_one
from aegis.core import recovery
from aegis.core.recovery import CheckType
from aegis.wire.messages import CheckResult

CHECKS: dict[CheckType, CheckFn] = {
    CheckType.IO: local.io_check,
    CheckType.GPU: gpu.gpu_check,
    CheckType.RUNTIME: group.runtime_check,
    CheckType.RDMA: rdma.rdma_check,
    CheckType.ALLREDUCE_CONNECT: group.allreduce_connect_check,
    CheckType.ALLREDUCE_PERF: group.allreduce_perf_check,
    CheckType.HANG: local.hang_check,
}
COLLECTIVE = group.COLLECTIVE
IN_CHILD = frozenset(group.MODES)  # answered by the round's check child

BOOTCHECK: tuple[CheckType, ...] = (CheckType.RUNTIME, CheckType.ALLREDUCE_CONNECT)
TROUBLESHOOT: tuple[CheckType, ...] = (
    CheckType.IO,
    CheckType.GPU,
    CheckType.RUNTIME,
    CheckType.RDMA,
    CheckType.ALLREDUCE_CONNECT,
    CheckType.ALLREDUCE_PERF,
    CheckType.HANG,
)


def registry() -> dict[CheckType, CheckFn]:
    return dict(CHECKS)


def plan(round_: tuple[CheckType, ...], settings: CheckSettings) -> list[tuple[CheckType, CheckFn]]:
    return [(t, CHECKS[t]) for t in round_ if settings.group is not None or t not in COLLECTIVE]


async def bootcheck(settings: CheckSettings) -> list[CheckResult]:
    return await _run_round(BOOTCHECK, settings)


async def troubleshoot(settings: CheckSettings) -> list[CheckResult]:
    """Every check in turn; allreduce_perf is skipped (not applicable) when allreduce_connect
    failed, so a missing pod costs one collective budget, not two."""
    wanted = settings.enabled
    return await _run_round(
        tuple(t for t in TROUBLESHOOT if wanted is None or t in wanted), settings
    )


def child_round(round_: tuple[CheckType, ...], settings: CheckSettings) -> group.CheckChildRound:
    """The child of a round runs the torch checks that will run here (not injected ones)."""
    wanted = [t for t, _ in plan(round_, settings) if t in IN_CHILD]
    if CheckType.ALLREDUCE_CONNECT.value in settings.inject:
        # allreduce_perf is skipped after a failed allreduce_connect
        wanted = [t for t in wanted if t not in COLLECTIVE]
    return group.CheckChildRound(settings, [t for t in wanted if t.value not in settings.inject])


async def _run_round(round_: tuple[CheckType, ...], settings: CheckSettings) -> list[CheckResult]:
    child = child_round(round_, settings)
    child.start_if_warm()  # a warm child joins its group while the local checks run
    try:
        if settings.suspect:
            return await _suspect_first(round_, settings, child)
        return await _run_planned(round_, settings, child, [])
    finally:
        await child.close()  # (a child that gave no verdict is killed)


async def _suspect_first(
    round_: tuple[CheckType, ...], settings: CheckSettings, child: group.CheckChildRound
) -> list[CheckResult]:
    """The suspect's node is checked first: its own checks (every one but the collectives) run
    before its collective checks. When they already say it must leave (``recovery.must_leave``:
    the master ends the round on that answer, ``core.resolution.concludes_early``), it answers
    at once and the collective checks are skipped: its peers' group would only wait for it."""
    own = tuple(t for t in round_ if t not in COLLECTIVE)
    results = await _run_planned(own, settings, child, [])
    verdict = recovery.classify(
        recovery.CheckOutcome(r.check_type, r.passed, r.timed_out) for r in results
    )
    rest = tuple(t for t in round_ if t in COLLECTIVE)
    if recovery.must_leave(verdict):
        skipped = [
            await run_one(t, _skipped_for(verdict), settings) for t, _ in plan(rest, settings)
        ]
        return results + skipped
    return await _run_planned(rest, settings, child, results)


async def _run_planned(
    round_: tuple[CheckType, ...],
    settings: CheckSettings,
    child: group.CheckChildRound,
    results: list[CheckResult],
) -> list[CheckResult]:
    for check_type, planned in plan(round_, settings):
        fn = planned
        connect = next((r for r in results if r.check_type is CheckType.ALLREDUCE_CONNECT), None)
        if check_type is CheckType.ALLREDUCE_PERF and connect is not None and not connect.passed:
            fn = _skipped
        elif check_type in child.checks:
            fn = _verdict_of(child, check_type)
        results.append(await run_one(check_type, fn, settings))
    return results


def _verdict_of(child: group.CheckChildRound, check_type: CheckType) -> CheckFn:
    async def verdict(settings: CheckSettings) -> Outcome:
        return await child.verdict(check_type)

    return verdict


async def _skipped(settings: CheckSettings) -> Outcome:
    return Outcome(True, "not_applicable: skipped, allreduce_connect failed", not_applicable=True)


def _skipped_for(verdict: recovery.Classification) -> CheckFn:
    async def skipped(settings: CheckSettings) -> Outcome:
        why = f"not_applicable: skipped, this node's own checks failed first ({verdict})"
        return Outcome(True, why, not_applicable=True)

    return skipped
