"""Running checks: each with a budget (an overrun fails with reason ``timeout``), blocking work in
a thread, and the chaos switch ``inject`` that makes a named check fail as broken hardware would
(it never touches any other code path)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aegis.checks import host as check_host
from aegis.core.recovery import CheckType
from aegis.wire.messages import CheckResult

DEFAULT_BUDGETS_S: Mapping[CheckType, float] = {
    CheckType.IO: 30.0,
    CheckType.GPU: 66.0,
    CheckType.RUNTIME: 30.0,  # the first import of torch, on a loaded node (then cached)
    CheckType.RDMA: 25.0,
    CheckType.ALLREDUCE_CONNECT: 122.0,
    CheckType.ALLREDUCE_PERF: 182.0,
    CheckType.HANG: 5.0,
}

INJECTED = "injected fault"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where the pods of a check round meet for collective checks."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    def port_for(self, check: CheckType) -> int:
        """A round's collective child (allreduce_connect, or both checks in one group) meets on
        master_port; a child running allreduce_perf alone on master_port + 1."""
        return self.master_port + (1 if check is CheckType.ALLREDUCE_PERF else 0)


@dataclass(frozen=True, slots=True)
class PerfSettings:
    """allreduce_perf: a fixed local matmul benchmark plus pairwise and world collective rounds."""

    compute_s: float = 0.5  # wall time of the local matmul benchmark ...
    window_s: float = 0.1  # ... judged by its best window of this length (5 windows)
    matrix: int = 128  # side of the float32 matrices multiplied
    pair_mb: float = 1.0  # payload of each pairwise ping-pong
    pair_iterations: int = 4
    pair_repeats: int = 5  # measurements per pair, the best one counts (3 was too noisy in CI)
    max_pair_rounds: int = 3
    allreduce_mb: float = 1.0
    slow_factor: float = 0.6  # compute below this fraction of the peers' median: slow
    pair_slow_factor: float = 0.25  # best-pair bandwidth below this fraction: slow (noisier)
    straggler_score: float = 0.0  # this pod's, from the training before the round (tie-breaker)


@dataclass(frozen=True, slots=True)
class CheckSettings:
    scratch_dir: Path = Path("/tmp")
    budgets_s: Mapping[CheckType, float] = field(default_factory=lambda: dict(DEFAULT_BUDGETS_S))
    inject: frozenset[str] = frozenset()  # check names that fail as broken hardware would
    enabled: frozenset[CheckType] | None = None  # troubleshooting runs only these (None: all)
    require_gpu: bool = False
    expect_rdma: bool = False
    io_size_mb: int = 16
    io_floor_mb_s: float = 5.0
    group: GroupInfo | None = None
    hung: bool = False  # the progress watchdog's verdict at the time of the round
    # The round's suspect (the master holds this pod hung or slow): its node's own checks run
    # first, and when they say it must leave it answers without joining the collective checks.
    suspect: bool = False
    gpu_count: int | None = None  # GPUs this node must show (None: any number)
    rdma_root: Path = Path("/sys/class/infiniband")
    expect_cuda: bool | None = None  # runtime: CUDA must (True) / must not (False) be usable
    perf: PerfSettings = field(default_factory=PerfSettings)
    host: check_host.CheckHost | None = None  # the agent's warm check interpreter (None: cold)
    ckpt_dir: Path | None = None  # the pod's durable checkpoint directory (the io check probes it)


@dataclass(frozen=True, slots=True)
class Outcome:
    passed: bool
    result: str
    not_applicable: bool = False


CheckFn = Callable[[CheckSettings], Awaitable[Outcome]]


async def run_one(check_type: CheckType, fn: CheckFn, settings: CheckSettings) -> CheckResult:
    started = time.monotonic()
    timed_out = False
    if check_type.value in settings.inject:
        outcome = Outcome(False, INJECTED)
    else:
        budget = settings.budgets_s.get(check_type, DEFAULT_BUDGETS_S[check_type])
        try:
            async with asyncio.timeout(budget):
                outcome = await fn(settings)
        except TimeoutError:
            outcome, timed_out = Outcome(False, f"timeout after {budget:g} s"), True
        except Exception as exc:  # a check that crashes is a failed check, with its reason
            outcome = Outcome(False, f"{type(exc).__name__}: {exc}")
    return CheckResult(
        check_type=check_type,
        passed=outcome.passed,
        result=outcome.result,
        duration_s=round(time.monotonic() - started, 4),
        ts=time.time(),
        not_applicable=outcome.not_applicable,
        timed_out=timed_out,
    )


async def run_all(
    checks: Sequence[tuple[CheckType, CheckFn]], settings: CheckSettings
) -> list[CheckResult]:
    return [await run_one(check_type, fn, settings) for check_type, fn in checks]
