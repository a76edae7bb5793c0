"""When the agent calls a stall a hang: the timeout, calibrated from the run itself (no I/O).

Default (``fixed_s`` None, the CLIs' ``--hang-timeout-s`` left out):

- **Steps seen** (``aegis.progress`` or, with no code change, the optimizer step hook): a stall
  is a hang after ``multiplier`` x the p99 of the step intervals this agent has seen in the
  run (every incarnation, the latest ``WINDOW``), kept within ``floor_s`` .. ``ceiling_s``.
  A CPU-only process tree that keeps its CPUs busy is still working (a long evaluation, a
  save): it is waited for up to ``ceiling_s``. A process with CUDA loaded is not given that
  benefit (a rank stuck in an NCCL collective spins a CPU).
- **Before the first step of an incarnation**, when an earlier one stepped: ``multiplier`` x the
  slowest first step seen, within floor and ceiling, from the incarnation's start.
- **No step signal at all** (no step seen in the run): a hang is ``quiet_s`` with no output and
  no CPU use by the process tree, so a rank that prints nothing while it computes is never
  reported.
- **Holding after a checkpoint the master asked for** (``hold_until``): never a hang.

``fixed_s`` > 0 (an explicit ``--hang-timeout-s``) wins: no progress and no output for that
long. Each decision carries its reason, for the log, the hang report and ``aegis status``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

WINDOW = 200  # step intervals kept: the run's recent pace, not its warm-up


@dataclass(frozen=True, slots=True)
class HangPolicy:
    fixed_s: float | None = None  # an explicit timeout: wins (None: calibrated)
    multiplier: float = 10.0
    floor_s: float = 30.0
    ceiling_s: float = 600.0  # NCCL's own default collective timeout
    quiet_s: float = 60.0  # no step signal: no output and no CPU this long is a hang

    def __post_init__(self) -> None:
        if self.fixed_s is not None and self.fixed_s <= 0:
            raise ValueError(f"fixed_s must be > 0 (None: calibrated), got {self.fixed_s}")
        if not 0 < self.floor_s <= self.ceiling_s or self.multiplier <= 0 or self.quiet_s <= 0:
            raise ValueError(f"bad hang policy {self}")


@dataclass(slots=True)
class StepHistory:
    """What this agent has seen of the run's steps (kept across in-place restarts)."""

    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    first_steps: list[float] = field(default_factory=list)  # start -> first step, per incarnation

    def stepped(self) -> bool:
        return bool(self.first_steps)


@dataclass(frozen=True, slots=True)
class Idle:
    """One look at an incarnation (monotonic seconds)."""

    now: float
    started: float  # the incarnation's start
    last_step_ts: float | None  # None: no step in this incarnation yet
    last_output_ts: float
    last_cpu_ts: float  # the last time the process tree used the CPU
    cuda: bool  # a process of the tree has CUDA loaded
    hold_until: float = 0.0  # the training holds after a requested checkpoint until then


@dataclass(frozen=True, slots=True)
class Verdict:
    hung: bool
    idle_s: float  # how long the relevant signal has been still
    timeout_s: float
    why: str  # how the timeout was chosen (and why a stall is not a hang yet)
    rule: str  # "fixed", "step", "busy", "first" or "quiet"


def flag(timeout_s: float | None) -> list[str]:
    """The agent's ``--hang-timeout-s`` for a setting (none: calibrated, the agent's default)."""
    return [] if timeout_s is None else ["--hang-timeout-s", str(timeout_s)]


def p99(values: Iterable[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _clamp(policy: HangPolicy, value: float) -> float:
    return min(policy.ceiling_s, max(policy.floor_s, value))


def step_timeout(policy: HangPolicy, history: StepHistory) -> tuple[float, str]:
    """The timeout of a stall after a step, and how it was chosen."""
    if not history.intervals:
        return policy.ceiling_s, f"no step interval seen yet: ceiling {policy.ceiling_s:g} s"
    tail = p99(history.intervals)
    raw = policy.multiplier * tail
    return _clamp(policy, raw), _bounded(
        policy, raw, f"{policy.multiplier:g} x p99 step {tail:.3g} s"
    )


def _bounded(policy: HangPolicy, raw: float, what: str) -> str:
    if raw < policy.floor_s:
        return f"{what} = {raw:.3g} s, floor {policy.floor_s:g} s"
    if raw > policy.ceiling_s:
        return f"{what} = {raw:.3g} s, ceiling {policy.ceiling_s:g} s"
    return f"{what} = {raw:.3g} s"


def judge(policy: HangPolicy, history: StepHistory, look: Idle) -> Verdict:
    """Whether the incarnation is hung now, and why (or why not yet)."""
    busy = look.now - look.last_cpu_ts < policy.quiet_s / 4
    if look.now < look.hold_until:  # saved for the master's request, waiting as asked
        left = look.hold_until - look.now
        return Verdict(False, 0.0, left, "holding after a requested checkpoint", "hold")
    if policy.fixed_s is not None:  # progress if the script reports it, else its output
        last = look.last_step_ts if look.last_step_ts is not None else look.last_output_ts
        idle = look.now - max(last, look.started)
        return Verdict(idle >= policy.fixed_s, idle, policy.fixed_s, "--hang-timeout-s", "fixed")
    if look.last_step_ts is not None:
        timeout, why = step_timeout(policy, history)
        idle = look.now - max(look.last_step_ts, look.hold_until)  # a hold is no stall
        if idle >= timeout and busy and not look.cuda and idle < policy.ceiling_s:
            why += f"; no step for {idle:.0f} s but busy on the CPU: waiting up to the ceiling"
            return Verdict(False, idle, policy.ceiling_s, why, "busy")
        return Verdict(idle >= timeout, idle, timeout, why, "step")
    if history.stepped():
        slowest = max(history.first_steps)
        raw = policy.multiplier * slowest
        timeout = _clamp(policy, raw)
        why = _bounded(
            policy, raw, f"first step: {policy.multiplier:g} x slowest first step {slowest:.3g} s"
        )
        idle = look.now - max(look.started, look.hold_until)
        if idle >= timeout and busy and not look.cuda and idle < policy.ceiling_s:
            return Verdict(False, idle, policy.ceiling_s, why + "; busy on the CPU", "busy")
        return Verdict(idle >= timeout, idle, timeout, why, "first")
    last = max(look.last_output_ts, look.last_cpu_ts, look.started, look.hold_until)
    idle = look.now - last
    why = f"no step signal: {policy.quiet_s:g} s with no output and no CPU use"
    return Verdict(idle >= policy.quiet_s, idle, policy.quiet_s, why, "quiet")


def record_step(
    history: StepHistory,
    started: float,
    previous: tuple[int, float] | None,
    seen: tuple[int, float],
) -> None:
    """A new report ``seen`` (step, ts) after ``previous`` (None: the first of its incarnation,
    timed from ``started``). Several steps between two looks count as their mean interval."""
    step, ts = seen
    if previous is None:
        history.first_steps.append(max(0.0, ts - started))
    elif step > previous[0] and ts > previous[1]:
        history.intervals.append((ts - previous[1]) / (step - previous[0]))
