"""Published theory of the checkpoint interval, and the expected-value model the search uses.

Young (CACM 1974): tau = sqrt(2 * C * M), first order, for C << M.
Daly (FGCS 22, 2006): the expected wall time of T_s of work, checkpoint cost C, restart R, MTBF M,
interval tau, with failures during checkpoints and restarts too:
    T_w = M * exp(R / M) * (exp((tau + C) / M) - 1) * T_s / tau,
and his higher-order estimate of its optimum
    tau = sqrt(2 C M) * (1 + sqrt(C / (2 M)) / 3 + C / (18 M)) - C   for C < 2 M, else M.
The effective training time ratio of that model is T_s / T_w. ``best_interval`` maximises it
numerically (golden-section search on log tau): the ``--ckpt-interval auto`` answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def young_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost_s


def expected_ratio(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float) -> float:
    """Useful time / wall time in Daly's model (exponential faults, the job is always running)."""
    wall_per_work = (
        mtbf_s
        * math.exp(restart_s / mtbf_s)
        * math.expm1((interval_s + cost_s) / mtbf_s)
        / interval_s
    )
    return 1.0 / wall_per_work


def best_interval(cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The interval that maximises ``expected_ratio`` (it does not depend on ``restart_s``)."""
    return _golden_max(
        lambda log_tau: expected_ratio(math.exp(log_tau), cost_s, mtbf_s, restart_s),
        math.log(max(cost_s, 1.0) * 1e-3),
        math.log(mtbf_s * 20.0),
    )


def _golden_max(f: Callable[[float], float], lo: float, hi: float) -> float:
    """argmax of a unimodal ``f`` on [lo, hi] (in log space); returns exp of it."""
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = f(c), f(d)
    while b - a > 1e-7:
        if fc > fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = f(d)
    return math.exp((a + b) / 2.0)
