"""Which checks run in which round: bootcheck and troubleshoot (DESIGN section 6).

Bootcheck = the environment report (the runtime check's result line, see
:mod:`aegis.checks.env`) + allreduce_connect; troubleshoot = every check. The collective checks
run only when ``settings.group`` says where the pods meet (allreduce_connect on its
``master_port``, allreduce_perf on ``master_port + 1``).
"""

from __future__ import annotations

from aegis.checks import gpu, group, local, rdma
from aegis.checks.base import CheckFn, CheckSettings, run_all
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
    return await run_all(plan(TROUBLESHOOT, settings), settings)
