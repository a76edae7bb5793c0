"""The best checkpoint interval found by simulation (the check on ``theory.best_interval``).

Runs the engine on a geometric grid of intervals around the model's optimum, with the same seeds
(the same fault traces) at every interval, and fits a parabola to the mean ratio in log interval:
the wasted fraction C / tau + tau / (2 M) is symmetric in log tau about its minimum, so the vertex
of the fit is an unbiased estimate of the best interval, far less noisy than the best grid point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from aegis.tools.simulate import engine, theory

GRID_FACTORS: tuple[float, ...] = (0.7, 0.79, 0.89, 1.0, 1.12, 1.26, 1.41)


@dataclass(frozen=True, slots=True)
class SearchResult:
    interval_s: float  # the vertex of the fit
    points: tuple[tuple[float, float], ...]  # (interval_s, mean simulated ratio)


def simulated_best_interval(
    spec: engine.SimSpec, seeds: Sequence[int], factors: Sequence[float] = GRID_FACTORS
) -> SearchResult:
    mtbf = spec.trace_spec().job_mtbf_s()
    center = theory.best_interval(spec.ckpt_cost_s, mtbf)
    points = []
    for factor in factors:
        interval = center * factor
        ratios = [
            engine.run(replace(spec, ckpt_interval_s=interval, seed=seed)).ratio for seed in seeds
        ]
        points.append((interval, sum(ratios) / len(ratios)))
    xs = [math.log(interval) for interval, _ in points]
    a, b = _parabola([x - xs[len(xs) // 2] for x in xs], [ratio for _, ratio in points])
    if a >= 0:  # no maximum in the grid: fall back to the best grid point
        return SearchResult(max(points, key=lambda p: p[1])[0], tuple(points))
    vertex = -b / (2.0 * a) + xs[len(xs) // 2]
    return SearchResult(math.exp(vertex), tuple(points))


def _parabola(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = a x^2 + b x + c; returns (a, b)."""
    n = float(len(xs))
    s1, s2 = sum(xs), sum(x * x for x in xs)
    s3, s4 = sum(x**3 for x in xs), sum(x**4 for x in xs)
    t0, t1 = sum(ys), sum(x * y for x, y in zip(xs, ys, strict=True))
    t2 = sum(x * x * y for x, y in zip(xs, ys, strict=True))
    # Normal equations [[s4 s3 s2] [s3 s2 s1] [s2 s1 n]] [a b c] = [t2 t1 t0], by Cramer's rule.
    det = _det3(s4, s3, s2, s3, s2, s1, s2, s1, n)
    a = _det3(t2, s3, s2, t1, s2, s1, t0, s1, n) / det
    b = _det3(s4, t2, s2, s3, t1, s1, s2, t0, n) / det
    return a, b


def _det3(  # noqa: PLR0913 (a 3x3 determinant, its nine entries)
    a: float, b: float, c: float, d: float, e: float, f: float, g: float, h: float, i: float
) -> float:
    return a * (e * i - f * h) - b * (d * i - f * g) + c * (d * h - e * g)
