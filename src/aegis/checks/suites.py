"""Which checks run in which round: bootcheck and troubleshoot (DESIGN section 6).

Bootcheck = the environment report (the runtime check's result line, see
:mod:`aegis.checks.env`) + allreduce_connect; troubleshoot = every check. The collective checks
run only when ``settings.group`` says where the pods meet (allreduce_connect on its
``master_port``, allreduce_perf on ``master_port + 1``).
"""

from __future__ import annotations

from aegis.checks import gpu, group, local, rdma
from aegis.checks.base import CheckFn, CheckSettings, Outcome, run_all, run_one
from aegis.core.recovery import CheckType
from aegis.wire.messages import CheckResult

CHECKS: dict[CheckType, CheckFn] = {
    CheckType.IO: local.io_check,
    CheckType.GPU: gpu.gpu_check,
    CheckType.RUNTIME: local.runtime_check,
    CheckType.RDMA: rdma.rdma_check,
    CheckType.ALLREDUCE_CONNECT: group.allreduce_connect_check,
    CheckType.ALLREDUCE_PERF: group.allreduce_perf_check,
    CheckType.HANG: local.hang_check,
}
COLLECTIVE = frozenset({CheckType.ALLREDUCE_CONNECT, CheckType.ALLREDUCE_PERF})

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
    return await run_all(plan(BOOTCHECK, settings), settings)


async def troubleshoot(settings: CheckSettings) -> list[CheckResult]:
    """Every check in turn; allreduce_perf is skipped (not applicable) when allreduce_connect
    failed, so a missing pod costs one collective budget, not two."""
    results: list[CheckResult] = []
    for check_type, fn in plan(TROUBLESHOOT, settings):
        connect = next((r for r in results if r.check_type is CheckType.ALLREDUCE_CONNECT), None)
        if check_type is CheckType.ALLREDUCE_PERF and connect is not None and not connect.passed:
            results.append(await run_one(check_type, _skipped, settings))
        else:
            results.append(await run_one(check_type, fn, settings))
    return results


async def _skipped(settings: CheckSettings) -> Outcome:
    return Outcome(True, "not_applicable: skipped, allreduce_connect failed", not_applicable=True)
