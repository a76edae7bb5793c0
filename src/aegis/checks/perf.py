"""allreduce_perf: figures measured in the collective child, and each pod's verdict on itself.

Every pod measures (1) a local matmul benchmark of fixed size for a fixed wall time (pure local:
comparable across pods on the same hardware), (2) pairwise ping-pong bandwidth in round-robin
pairing rounds, one repeat after each compute round so that the pair figures span the whole
check (a slow pod drags down every pair it is in, a healthy pod has at least one fast pair), and
(3) the world all_reduce bandwidth (reported only: a slow pod slows everyone's).
Each link's buffers are sized to what it has shown it moves (``aegis.checks.links``): the
configured ones on a fast network, smaller ones on a link too slow to move those in the check's
time (a NIC down to 200 kbit/s), so the check names its pod instead of timing out; the world
all_reduce's by the slowest link of all.
The figures are all_gathered, so each pod judges itself against the median of its peers: below
``slow_factor`` times that median on compute or on best-pair bandwidth is ``slow``. With two pods
the pair figure is shared, and the compute pairing decides.

The compute figure is robust to a loaded machine (one loaded run rated a healthy pod 0.59x of
its peers from its best 0.1-s window): it is measured in several rounds, every pod at once (a
barrier starts each round), and the pod's rating is the second best over rounds of its ratio to
its peers' median *in that round*. A busy neighbour or a scheduler's hiccup that holds one pod
up, even in most rounds, does not make it slow; a slow pod is slow in every round. On a CPU a
round's figure is the best of one window on each of up to three of the pod's CPUs
(:func:`round_cpus`), the pods of one host on different ones at once: the CPUs of one machine
need not compute alike (a virtual machine's two vCPUs ran the same product at 140 and 77-110
GFLOP/s for seconds, with no run delay and no steal time to show for it: the host's other load
on their siblings), and a pod left on the slow one read 0.55x of its peer in all five rounds.
Every pod of such a host reads its fast CPU in every round, so the gap cancels in each round's
ratio; a slow node is slow on every CPU.

The straggler score as the tie-breaker (:func:`tie_break`): when the figures name no pod slow
and the pod with the highest straggler score of the training before the round (the master's,
``aegis.core.stragglers``: a rank slow before the collective, such as a slow data loader, looks
like its peers to every figure here) rates within noise of the lowest, that pod is named slow.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aegis.checks import cgroup_cpu, links


@dataclass(frozen=True, slots=True)
class Verdict:
    slow: bool
    text: str


def _ratio(mine: float, peers: Sequence[float]) -> tuple[float, float]:
    median = statistics.median(peers)
    return (mine / median if median > 0 else 1.0), median


def round_ratios(rounds: Sequence[Sequence[float]], rank: int) -> list[float]:
    """This pod's ratio to its peers' median in each round (``rounds[r][rank]``: GFLOP/s of
    ``rank`` in round ``r``)."""
    return [_ratio(figures[rank], [v for i, v in enumerate(figures) if i != rank])[0]
            for figures in rounds]  # fmt: skip


def rating(ratios: Sequence[float]) -> float:
    """A pod's compute rating from its per-round ratios: the second best (the best of one or
    two rounds). A slow node is slow in every round; so it must be below the factor in all
    rounds but one to be slow: a loaded 2-CPU machine held a healthy pod at 0.57-0.66x for all
    of a 1.5-s check (its rounds' median 0.59x: a false verdict), never in every round."""
    ordered = sorted(ratios)
    return ordered[-2] if len(ordered) >= 2 else ordered[0]


TIE_NOISE = 0.2  # ratings this close to the lowest cannot be told apart (a loaded machine)
TIE_MIN_SCORE = 0.1  # steps behind its peers: a straggler score that can break a tie


@dataclass(frozen=True, slots=True)
class TieBreak:
    rank: int  # the rank named by its straggler score
    text: str


def ratings(compute: Sequence[float], rounds: Sequence[Sequence[float]] = ()) -> list[float]:
    """Every rank's compute rating as :func:`judge` rates it (one list: every pod computes the
    same from the gathered figures)."""
    if rounds:
        return [rating(round_ratios(rounds, r)) for r in range(len(compute))]
    return [
        _ratio(v, [w for i, w in enumerate(compute) if i != r])[0] if len(compute) > 1 else 1.0
        for r, v in enumerate(compute)
    ]


def tie_break(
    rated: Sequence[float],
    scores: Sequence[float],
    factor: float,
    noise: float = TIE_NOISE,
    min_score: float = TIE_MIN_SCORE,
) -> TieBreak | None:
    """The rank the straggler scores name when the ratings cannot: None when some rank rates
    below ``factor`` (the figures decide), when no score reaches ``min_score`` or two ranks
    share the highest, or when the highest scorer rates more than ``noise`` above the lowest
    rating (the figures point elsewhere). ``rated`` and ``scores`` by rank (a score per rank,
    0.0 where the master has none)."""
    if len(rated) != len(scores):
        raise ValueError(f"{len(scores)} straggler scores for {len(rated)} ranks")
    if len(rated) < 2 or min(rated) < factor:
        return None
    top = max(scores)
    if top < min_score or list(scores).count(top) > 1:
        return None
    rank = list(scores).index(top)
    lowest = min(rated)
    if rated[rank] - lowest > noise:
        return None
    return TieBreak(
        rank,
        f"named by its straggler score ({top:.2f} steps behind its peers in training): the "
        f"ratings {lowest:.2f}-{max(rated):.2f} are within noise ({noise:g})",
    )


def judge(
    compute: Sequence[float],
    pair: Sequence[float],
    rank: int,
    factor: float,
    pair_factor: float = 0.25,
    rounds: Sequence[Sequence[float]] = (),
    scores: Sequence[float] = (),
) -> Verdict:
    """This pod's verdict from every pod's figures (GFLOP/s, best pair MB/s), indexed by rank.

    With ``rounds`` (every pod's GFLOP/s per round) the compute rating is the second best over
    rounds of the pod's ratio to its peers' median in that round (:func:`rating`; ``compute``:
    each pod's median figure, for the text); without, the ratio of ``compute`` figures.

    Pair bandwidth is noisier than the compute figure (a few milliseconds per measurement), so
    it names a pod slow only below ``pair_factor`` of its peers' median (a clearly bad link).

    ``scores``: every rank's straggler score from the training before the round (empty: none);
    when no figure names any pod slow, :func:`tie_break` may name this one.
    """
    mine_c = compute[rank]
    peers_c = [v for r, v in enumerate(compute) if r != rank]
    if not peers_c:
        return Verdict(False, f"compute {mine_c:.2f} GFLOP/s (no peers to compare)")
    ratio_c, median_c = _ratio(mine_c, peers_c)
    parts = [f"compute {mine_c:.2f} GFLOP/s = {ratio_c:.2f}x peers' median {median_c:.2f}"]
    if rounds:
        ratios = round_ratios(rounds, rank)
        ratio_c = rating(ratios)
        parts = [
            f"compute {mine_c:.2f} GFLOP/s, {ratio_c:.2f}x peers' median (second best of "
            f"{len(ratios)} rounds: {' '.join(f'{r:.2f}' for r in ratios)})"
        ]
    slow = ratio_c < factor
    peers_p = [v for r, v in enumerate(pair) if r != rank]
    if peers_p and pair[rank] > 0:
        ratio_p, median_p = _ratio(pair[rank], peers_p)
        parts.append(
            f"best pair {pair[rank]:.3g} MB/s = {ratio_p:.2g}x peers' median {median_p:.3g}"
        )
        slow = slow or ratio_p < pair_factor
    text = "; ".join(parts)
    if slow:
        return Verdict(True, f"slow (below {factor:g}x of peers): {text}")
    tie = tie_break(ratings(compute, rounds), scores, factor) if scores else None
    if tie is not None and tie.rank == rank and not _pair_slow(pair, pair_factor):
        return Verdict(True, f"slow ({tie.text}): {text}")
    return Verdict(False, text)


def _pair_slow(pair: Sequence[float], pair_factor: float) -> bool:
    """Whether any rank's best pair names it slow (then the figures decided)."""
    for r, mine in enumerate(pair):
        peers = [v for i, v in enumerate(pair) if i != r]
        if peers and mine > 0 and _ratio(mine, peers)[0] < pair_factor:
            return True
    return False


def run_delay_s() -> float:
    """Seconds this thread has waited on a run queue (runnable, not running); 0 if unknown."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


# The compute figure: COMPUTE_ROUNDS rounds of ROUND_WINDOWS x ``window_s`` (0.3 s; one window
# on a GPU, one on each of up to ROUND_WINDOWS CPUs: ``round_cpus``): long enough to span a few
# periods of a node that is slow in bursts (a duty-cycled or throttled one; the barrier that
# starts a round waits for it, so a round starts while it runs), and time spent waiting for a
# CPU is not counted (``_compute``), so load is not slowness.
COMPUTE_ROUNDS = 5
ROUND_WINDOWS = 3
GPU_MATRIX = 4096  # on a GPU a small product measures launch latency, not the GPU


def _compute(torch: Any, side: int, seconds: float, window_s: float, device: Any = None,
             limits: Sequence[Path] | None = None) -> float:  # fmt: skip
    """GFLOP/s of the best ``window_s`` window within ``seconds``, on ``device`` (the GPU the
    collectives use, else the CPU).

    Time spent runnable but waiting for a CPU (other processes on the host) is not counted, so
    a busy neighbour does not make a healthy pod look slow; a pod that is really slow (held back
    by its cgroup's CPU limit, stopped, slow hardware) is slow in every window: the run delay
    its limit caused counts (``cgroup_cpu``). On a GPU each product is waited for, so a window
    counts finished work. ``limits``: the ``cpu.stat`` files of the process's cgroups (None:
    read them here).
    """
    cuda = getattr(device, "type", "cpu") == "cuda"
    if cuda:
        side = max(side, GPU_MATRIX)
    a = torch.randn(side, side, device=device)
    b = torch.randn(side, side, device=device)
    limits = cgroup_cpu.own_stat_files() if limits is None else limits
    best = 0.0
    end = time.monotonic() + seconds
    while best == 0.0 or time.monotonic() < end:  # at least one window, however loaded
        count = 0
        started, delayed = time.monotonic(), run_delay_s()
        throttled = cgroup_cpu.throttled_s(limits)
        while (elapsed := time.monotonic() - started) < window_s:
            torch.mm(a, b)
            if cuda:
                torch.cuda.synchronize(device)
            count += 1
        busy = cgroup_cpu.busy_s(
            elapsed, run_delay_s() - delayed, cgroup_cpu.throttled_s(limits) - throttled
        )
        best = max(best, 2.0 * side**3 * count / busy / 1e9)
    return best


def round_cpus(cpus: Sequence[int], rank: int, round_index: int) -> list[int | None]:
    """The CPUs that ``rank`` computes round ``round_index`` on, one window each: up to
    ``ROUND_WINDOWS`` of ``cpus`` in turn, the ranks sharing a host on different ones at once,
    the next round going on where this one stopped; ``[None]`` (left where it is) with fewer
    than two."""
    if len(cpus) < 2:
        return [None]
    width = min(len(cpus), ROUND_WINDOWS)
    start = rank + round_index * width
    return [cpus[(start + k) % len(cpus)] for k in range(width)]


@contextlib.contextmanager
def _pinned(cpu: int | None) -> Iterator[None]:
    """The calling thread on ``cpu`` for the block, then back on the CPUs it had."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # a CPU taken away meanwhile (a cpuset changed): measured where it is
        before = set()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # (the CPUs it had, less any taken away meanwhile)
            if before:
                os.sched_setaffinity(0, before)


def _round_figure(
    torch: Any,
    side: int,
    round_s: float,
    device: Any,
    visits: Sequence[int | None],
    limits: Sequence[Path] | None = None,
) -> float:
    """A compute round's GFLOP/s: the best of one window of ``round_s / len(visits)`` on each
    CPU of ``visits`` (None: wherever the thread is); ``limits``: see :func:`_compute`."""
    window_s = round_s / len(visits)
    figure = 0.0
    for cpu in visits:
        with _pinned(cpu):
            figure = max(figure, _compute(torch, side, window_s, window_s, device, limits))
    return figure


def _measure(torch: Any, dist: Any, args: Any, device: Any, count: int, round_s: float,
             pairs: links.Links | None = None) -> tuple[list[float], float]:  # fmt: skip
    """GFLOP/s in each of ``count`` compute rounds (every pod at once, a barrier starts each) and
    the best ping-pong MB/s over this pod's pairs, one repeat of every pairing after each compute
    round: the pair figures span the whole check, not a burst of a few hundred milliseconds that
    one stretch of starvation on a loaded host covers (a healthy pod held up through all of its
    pair measurements at once read 0.09x of its peers and was evicted). ``pairs``: the links,
    probed (``links.Links``; else every buffer ``pair_mb``)."""
    pairs = pairs or links.Links(torch, dist, args, device, adapt=False)
    cpus = [] if getattr(device, "type", "cpu") == "cuda" else sorted(os.sched_getaffinity(0))
    limits = cgroup_cpu.own_stat_files()  # once: the cgroup does not change within a check
    figures: list[float] = []
    best = 0.0
    for i in range(max(count, args.pair_repeats)):
        if i < count:
            dist.barrier()
            figures.append(_round_figure(torch, args.matrix, round_s, device,
                                         round_cpus(cpus, args.rank, i), limits))  # fmt: skip
        if i < args.pair_repeats:
            best = max(best, pairs.repeat())
    dist.barrier()
    return figures, best


def _allreduce_bandwidth(torch: Any, dist: Any, mb: float, device: Any, link_rate: float) -> float:
    # four all_reduces, each about two sends of the buffer on the slowest link (a ring's)
    floats = links.sized_floats(link_rate, links.ALLREDUCE_BUDGET_S, 8, mb)
    buf = torch.ones(floats, dtype=torch.float32, device=device)
    dist.all_reduce(buf)
    started = time.monotonic()
    for _ in range(3):
        dist.all_reduce(buf)
    return float(3 * buf.numel() * 4 / max(time.monotonic() - started, 1e-9) / 1e6)


def run_round(torch: Any, dist: Any, args: Any, device: Any) -> dict[str, Any]:
    """Runs inside the collective child with the process group initialised."""
    dist.barrier()
    count = COMPUTE_ROUNDS
    round_s = max(args.compute_s / count, ROUND_WINDOWS * args.window_s)  # 0.3 s by default
    pairs = links.Links(torch, dist, args, device, adapt=True)
    pairs.probe()
    mine_rounds, pair = _measure(torch, dist, args, device, count, round_s, pairs)
    rate = pairs.slowest()
    allreduce = _allreduce_bandwidth(torch, dist, args.allreduce_mb, device, rate)
    score = getattr(args, "straggler_score", 0.0)
    mine = torch.tensor([pair, score, *mine_rounds], dtype=torch.float64, device=device)
    everyone = [torch.zeros(count + 2, dtype=torch.float64, device=device)
                for _ in range(args.world_size)]  # fmt: skip
    dist.all_gather(everyone, mine)
    rows = [[float(v) for v in t.tolist()] for t in everyone]
    out = round_verdict(rows, args.rank, args.slow_factor, args.pair_slow_factor)
    out["result"] = f"{out['result']}; world all_reduce {allreduce:.3g} MB/s"
    if pairs.sizes and (least := min(pairs.sizes.values())) < pairs.full:
        out["result"] += (
            f"; pair buffers down to {least / 256:.3g} KiB "
            f"(the slowest link of all {rate / 1e3:.3g} kB/s)"
        )
    out["allreduce_mb_s"] = allreduce
    return out


def round_verdict(
    rows: Sequence[Sequence[float]], rank: int, factor: float, pair_factor: float
) -> dict[str, Any]:
    """This rank's verdict from every rank's gathered row: best pair MB/s, straggler score,
    then GFLOP/s per compute round. The scores break a tie only when some rank has one."""
    pairs = [row[0] for row in rows]
    scores = [row[1] for row in rows]
    by_round = [[row[2 + r] for row in rows] for r in range(len(rows[0]) - 2)]
    computes = [statistics.median(row[2:]) for row in rows]
    verdict = judge(computes, pairs, rank, factor, pair_factor, by_round,
                    scores if any(s > 0 for s in scores) else ())  # fmt: skip
    text = verdict.text
    return {
        "passed": not verdict.slow,
        "slow": verdict.slow,
        "result": text,
        "compute_gflops": computes,
        "compute_rounds_gflops": by_round,
        "pair_mb_s": pairs,
        "straggler_scores": scores,
    }
