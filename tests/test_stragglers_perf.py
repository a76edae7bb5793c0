"""allreduce_perf's compute rating (checks/perf.py) is robust to a loaded machine: the second best
over rounds, every pod measuring at once, of the pod's ratio to its peers' median in that
round."""

from __future__ import annotations

import itertools
import os
import types

import pytest

from aegis.checks import links, perf


def rounds_of(*per_rank: list[float]) -> list[list[float]]:
    """Per-rank figures of each round -> per-round figures of each rank."""
    return [list(figures) for figures in zip(*per_rank, strict=True)]


def test_a_healthy_pod_held_up_in_some_rounds_is_not_slow() -> None:
    """The loaded run of issue 18 rated a healthy pod 0.59x of its peers from its best window;
    held up in two rounds of five (0.59x, 0.3x), it is rated by the other three."""
    rounds = rounds_of(
        [59.0, 100.0, 30.0, 98.0, 101.0], [100.0] * 5, [100.0, 99.0, 100.0, 100.0, 100.0]
    )
    verdict = perf.judge([98.0, 100.0, 100.0], [900.0] * 3, 0, 0.6, 0.25, rounds)
    assert not verdict.slow, verdict.text
    assert "second best of 5 rounds: 0.59 1.01 0.30 0.98 1.01" in verdict.text
    # without the rounds the same pod's median figure is judged as before
    assert perf.judge([59.0, 100.0, 100.0], [900.0] * 3, 0, 0.6).slow


def test_a_slow_pod_is_slow_in_every_round_even_when_its_peers_are_held_up_in_one() -> None:
    rounds = rounds_of([20.0, 22.0, 21.0, 20.0, 19.0], [100.0, 10.0, 100.0, 98.0, 100.0],
                       [100.0, 12.0, 99.0, 100.0, 100.0])  # fmt: skip
    verdict = perf.judge([20.0, 99.0, 99.0], [900.0] * 3, 0, 0.6, 0.25, rounds)
    assert verdict.slow and verdict.text.startswith("slow (below 0.6x of peers)"), verdict.text
    # and its peers are not slow for the round they were held up in
    for rank in (1, 2):
        assert not perf.judge([20.0, 99.0, 99.0], [900.0] * 3, rank, 0.6, 0.25, rounds).slow


def test_a_healthy_pod_held_at_0_59x_in_most_rounds_is_not_slow() -> None:
    """Run 47 of the loaded e2e: a healthy pod at 0.66 0.66 0.58 0.59 0.57 of its peers for the
    whole check (median 0.59x: slow by the median rule); a slow pod is below in every round."""
    ratios = [0.66, 0.66, 0.58, 0.59, 0.57]
    assert perf.rating(ratios) == 0.66
    assert perf.rating([0.08, 0.11, 0.08, 0.07, 0.10]) == 0.10
    assert perf.rating([0.08, 0.95, 0.08, 0.07, 0.10]) == 0.10  # one lucky round: still slow
    assert perf.rating([0.4]) == 0.4


def test_round_ratios_table() -> None:
    rounds = [[50.0, 100.0, 100.0], [100.0, 100.0, 50.0], [0.0, 0.0, 0.0]]
    assert perf.round_ratios(rounds, 0) == [0.5, pytest.approx(4 / 3), 1.0]  # peers at 0: 1.0
    assert perf.round_ratios(rounds, 2) == [pytest.approx(4 / 3), 0.5, 1.0]


class FakeClock:
    """The check's clock: a product takes 10 ms, a send or receive 1 ms, or 10 ms while this
    pod is held up (runnable but starved: a loaded host; 0.09x its peers in the run that named
    a healthy pod slow)."""

    def __init__(self, starved: tuple[float, float] = (0.0, 0.0)) -> None:
        self.now, self.starved = 0.0, starved

    def monotonic(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        start, end = self.starved
        self.now += seconds * (10 if start <= self.now < end else 1)


def current_cpu() -> int:
    """The CPU the calling thread runs on now (/proc: field 39 of its stat)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def measure(
    clock: FakeClock,
    calls: list[str],
    rank: int = 0,
    cpus: list[int] | None = None,
    slow_cpu: int | None = None,
) -> tuple[list[float], float]:
    """``perf._measure`` for ``rank`` of 3 on the fake clock: 5 compute rounds of 0.3 s, 5 pair
    repeats of 4 ping-pongs of 1 MB; ``cpus`` gets the CPU of each product, and a product on
    ``slow_cpu`` takes 1.8 times as long (a vCPU whose host sibling is busy)."""

    class FakeTorch:
        float32 = "float32"

        @staticmethod
        def randn(*shape: int, device: object = None) -> tuple[int, ...]:
            return shape

        @staticmethod
        def zeros(n: int, dtype: object = None, device: object = None) -> object:
            return types.SimpleNamespace(numel=lambda: n)

        @staticmethod
        def mm(a: object, b: object) -> None:
            calls.append("mm")
            cpu = current_cpu()
            if cpus is not None:
                cpus.append(cpu)
            clock.step(0.018 if cpu == slow_cpu else 0.01)

    def transfer(kind: str) -> object:
        def call(buf: object, peer: int) -> None:
            calls.append(kind)
            clock.step(0.001)

        return call

    dist = types.SimpleNamespace(
        barrier=lambda: calls.append("barrier"), send=transfer("send"), recv=transfer("recv")
    )
    args = types.SimpleNamespace(matrix=64, pair_mb=1.0, pair_repeats=5, world_size=3,
                                 max_pair_rounds=3, rank=rank, pair_iterations=4)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(perf, "time", clock)
        mp.setattr(links, "time", clock)
        mp.setattr(perf, "run_delay_s", lambda: 0.0)
        return perf._measure(FakeTorch, dist, args, None, 5, 0.3)


def test_round_cpus_visit_each_cpu_in_turn_and_keep_the_ranks_of_a_host_apart() -> None:
    assert [perf.round_cpus([0, 1], 0, i) for i in range(3)] == [[0, 1]] * 3
    assert [perf.round_cpus([0, 1], 1, i) for i in range(3)] == [[1, 0]] * 3
    assert perf.round_cpus([2, 5, 7], 4, 0) == [5, 7, 2]
    # more CPUs than windows: the next round goes on where this one stopped
    assert [perf.round_cpus([0, 1, 2, 3], 0, i) for i in range(3)] == [
        [0, 1, 2], [3, 0, 1], [2, 3, 0]
    ]  # fmt: skip
    assert perf.round_cpus([3], 0, 0) == [None] and perf.round_cpus([], 1, 2) == [None]


def runs_of(cpus: list[int]) -> list[int]:
    """The CPUs in the order the products ran on them, one entry per run of products."""
    return [cpu for cpu, _ in itertools.groupby(cpus)]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_compute_round_takes_one_window_on_each_cpu_then_the_thread_is_let_go() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    for rank in (0, 1):
        ran_on: list[int] = []
        measure(FakeClock(), [], rank, ran_on)
        expected = [cpu for i in range(5) for cpu in perf.round_cpus(allowed, rank, i)]
        assert runs_of(ran_on) == expected
        assert sorted(os.sched_getaffinity(0)) == allowed


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="needs exactly two CPUs")
def test_two_healthy_pods_on_a_host_whose_second_cpu_is_slower_rate_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPUs of one virtual machine differed (140 against 77 GFLOP/s for seconds, no run
    delay, no steal), and the pod left on the slow one read 0.55x in all five rounds: named
    slow (a CI failure). Each round now takes the best of a window on each CPU, so both pods
    read the fast one in every round and the gap cancels."""
    allowed = sorted(os.sched_getaffinity(0))
    slow = allowed[1]
    figures = []
    for rank in (0, 1):  # the scheduler put rank 1 on the slow CPU, and may run it on either
        os.sched_setaffinity(0, {allowed[rank]})
        try:
            monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(allowed))
            figures.append(measure(FakeClock(), [], rank, slow_cpu=slow)[0])
        finally:
            monkeypatch.undo()
            os.sched_setaffinity(0, allowed)
    fast = 2 * 64**3 / 0.01 / 1e9
    assert all(f == pytest.approx(fast) for row in figures for f in row), figures
    by_round = [list(pair) for pair in zip(*figures, strict=True)]
    for rank in (0, 1):
        verdict = perf.judge([fast, fast], [900.0] * 2, rank, 0.6, 0.25, by_round)
        assert not verdict.slow and "second best of 5 rounds: 1.00 1.00" in verdict.text


def test_compute_rounds_start_together_after_a_barrier() -> None:
    calls: list[str] = []
    figures, pair = measure(FakeClock(), calls)
    assert len(figures) == 5 and all(f == pytest.approx(2 * 64**3 / 0.01 / 1e9) for f in figures)
    assert pair == pytest.approx(2 * 262144 * 4 * 4 / 0.008 / 1e6)  # 1 MB there and back, 4 times
    # each round's products come right after a barrier, and a pair repeat after each round
    starts = [i for i, c in enumerate(calls) if calls[i : i + 2] == ["barrier", "mm"]]
    assert len(starts) == 5
    between = [calls[a:b] for a, b in zip(starts, [*starts[1:], len(calls)], strict=True)]
    assert all(part.count("send") == 2 * 4 for part in between)  # two partners of rank 0


def test_a_stretch_of_starvation_anywhere_in_the_check_leaves_the_best_pair_healthy() -> None:
    """A pod held up for a second (every send and receive 10 times slower) keeps its healthy
    best pair wherever that second falls: the pair repeats come between the compute rounds,
    0.3 s apart. Measured in one burst after the compute rounds (0.8 s when held up), all of
    them fell in a second that began as the compute ended, and the pair read 0.1x."""
    healthy = measure(FakeClock(), [])[1]
    for tenth in range(25):
        start = tenth / 10
        pair = measure(FakeClock(starved=(start, start + 1.0)), [])[1]
        assert pair == pytest.approx(healthy), start


def test_buffers_keep_their_size_on_a_fast_link_and_shrink_to_fit_a_slow_ones_budget() -> None:
    mb = 262144  # float32s in 1 MB
    args = types.SimpleNamespace(pair_mb=1.0, pair_repeats=5, world_size=4, max_pair_rounds=3,
                                 pair_iterations=4)  # fmt: skip
    assert links.pair_floats(args, float("inf")) == mb  # one pod, no pairs probed
    assert links.pair_floats(args, 1e9) == mb  # 1 GB/s
    assert links.pair_floats(args, 12.5e6) == mb  # 100 Mbit/s: 120 MB in 10 s, within budget
    slow = 25e3  # 200 kbit/s: 120 transfers of 1 MB would take 80 minutes
    floats = links.pair_floats(args, slow)
    assert floats < mb and 120 * floats * 4 / slow == pytest.approx(links.PAIR_BUDGET_S, rel=0.01)
    assert links.pair_floats(args, 10.0) == links.LEAST_FLOATS  # never below 4 KB
    assert links.sized_floats(0.0, 5.0, 8, 0.001) == 262  # and never above the configured size
    assert links.sized_floats(float("nan"), 5.0, 8, 1.0) == mb


class _Wire:
    """Rank 0 of 3 and its two partners on a fake clock: a send or receive of ``n`` bytes to
    ``peer`` takes 50 us plus ``n / rates[peer]``, ten thousand times longer while ``stalled``
    (the pod held up on a loaded host)."""

    float32, float64, int64 = "float32", "float64", "int64"

    def __init__(self, rates: dict[int, float]) -> None:
        self.rates, self.now, self.stalled = rates, 0.0, False
        self.ReduceOp = types.SimpleNamespace(MIN="min")

    def monotonic(self) -> float:
        return self.now

    def zeros(self, n: int, dtype: object = None, device: object = None) -> object:
        return types.SimpleNamespace(numel=lambda: n)

    def tensor(self, values: list[float], dtype: object = None, device: object = None) -> object:
        return types.SimpleNamespace(numel=lambda: len(values), item=lambda: values[0])

    def move(self, buf: types.SimpleNamespace, peer: int) -> None:
        cost = 50e-6 + buf.numel() * 4 / self.rates[peer]
        self.now += cost * (10_000 if self.stalled else 1)

    send = recv = move

    def barrier(self) -> None:
        return None

    def all_reduce(self, t: object, op: object = None) -> None:
        return None


def _links(wire: _Wire) -> links.Links:
    args = types.SimpleNamespace(pair_mb=1.0, pair_repeats=5, world_size=3, max_pair_rounds=3,
                                 rank=0, pair_iterations=4)  # fmt: skip
    return links.Links(wire, wire, args, None, adapt=True)


def _best_of_repeats(wire: _Wire, pairs: links.Links) -> float:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(links, "time", wire)
        pairs.probe()
        wire.stalled = False
        return max(pairs.repeat() for _ in range(5))


def test_a_pod_held_up_through_its_probes_is_measured_with_full_buffers_after_one_repeat() -> None:
    calm = _Wire({1: 1e9, 2: 1e9})
    healthy = _best_of_repeats(calm, _links(calm))
    wire = _Wire({1: 1e9, 2: 1e9})
    pairs = _links(wire)
    wire.stalled = True  # through the whole probe
    best = _best_of_repeats(wire, pairs)
    assert best == pytest.approx(healthy, rel=0.01)  # judged at full size, as its peers
    assert list(pairs.sizes.values()) == [pairs.full, pairs.full]  # both of its partners


def test_a_slow_link_gets_small_buffers_and_the_fast_one_keeps_its_own_within_budget() -> None:
    wire = _Wire({1: 25e3, 2: 1e9})  # the link to rank 1: 200 kbit/s
    pairs = _links(wire)
    best = _best_of_repeats(wire, pairs)
    slow_round = next(r for r in range(3) if links.pairing(3, r).get(0) == 1)
    fast_round = next(r for r in range(3) if links.pairing(3, r).get(0) == 2)
    assert pairs.sizes[fast_round] == pairs.full and pairs.sizes[slow_round] < pairs.full // 50
    assert best > 100  # MB/s: the fast pair, at full size
    assert wire.now < links.PAIR_BUDGET_S  # 1-MB buffers on that link: 80 minutes
