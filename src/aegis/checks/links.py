"""allreduce_perf's pair links: ping-pong figures between the partners of round-robin pairing
rounds, with buffers sized to each link.

A first small exchange (PROBE_FLOATS there and back, best of two) gives each link a rate.
Before every measurement the lower rank of the pair sizes the buffer from the best rate that
link has shown so far, and sends the size to its partner (both must move the same buffer): on
a fast network it is the configured ``pair_mb``; on a link too slow to move that in the check's
time (a NIC down to 200 kbit/s), a buffer it moves within PAIR_BUDGET_S (:func:`sized_floats`),
so the check names its pod instead of timing out on every pod. A link's best rate only grows:
a pod held up through its probes (a loaded host) measures once with a small buffer, then with
the full one, and its best pair is not judged on the small one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

PROBE_FLOATS = 8192  # 32 KB
PAIR_BUDGET_S = 30.0  # a pod's pair measurements on a slow link, at most about this long
ALLREDUCE_BUDGET_S = 5.0  # the world all_reduce's, on the slowest link of all
LEAST_FLOATS = 1024  # 4 KB: below, a figure is all latency


def pairing(world: int, round_: int) -> dict[int, int]:
    """Round ``round_`` of the circle method: rank -> partner (ranks left out have none)."""
    n = world + (world % 2)
    ring = list(range(1, n))
    shift = round_ % max(n - 1, 1)
    order = [0, *(ring[shift:] + ring[:shift])]
    partners = {}
    for i in range(n // 2):
        a, b = order[i], order[n - 1 - i]
        if a < world and b < world:
            partners[a], partners[b] = b, a
    return partners


def rounds(world: int, max_rounds: int) -> int:
    return min(world + (world % 2) - 1, max_rounds) if world > 1 else 0


def sized_floats(rate: float, budget_s: float, transfers: int, most_mb: float) -> int:
    """Float32s in a buffer of which ``transfers`` one-way sends take ``budget_s`` at ``rate``
    bytes/s: the configured ``most_mb`` when that fits, else fewer, down to LEAST_FLOATS."""
    most = max(int(most_mb * 262144), 1)
    if not math.isfinite(rate):
        return most
    fits = int(max(rate, 0.0) * budget_s / max(transfers, 1) / 4)
    return max(min(most, fits), min(most, LEAST_FLOATS))


def pair_floats(args: Any, link_rate: float) -> int:
    """A pair buffer's float32s: a pod's pair measurements (``pair_repeats`` x its pairing
    rounds x ``pair_iterations``, there and back) within PAIR_BUDGET_S, all at ``link_rate``."""
    pairs = rounds(args.world_size, args.max_pair_rounds)
    transfers = args.pair_repeats * pairs * args.pair_iterations * 2
    return sized_floats(link_rate, PAIR_BUDGET_S, transfers, args.pair_mb)


def _nothing() -> None:
    return None


def ping_pong(
    dist: Any, buf: Any, rank: int, partner: int, iterations: int, sync: Callable[[], None]
) -> float:
    """MB/s of ``iterations`` round trips of ``buf`` with ``partner`` (the lower rank sends
    first); ``sync`` waits for the device (NCCL's send and recv return before the transfer)."""
    sync()
    started = time.monotonic()
    for _ in range(iterations):
        if rank < partner:
            dist.send(buf, partner)
            dist.recv(buf, partner)
        else:
            dist.recv(buf, partner)
            dist.send(buf, partner)
    sync()
    elapsed = max(time.monotonic() - started, 1e-9)
    return float(2 * buf.numel() * 4 * iterations / elapsed / 1e6)


class Links:
    """This pod's links to its partners, by pairing round: the best rate each has shown (bytes
    per second) and the buffer size of its last measurement. ``adapt`` False: every buffer is
    ``pair_mb``, with no probe and no size exchanged."""

    def __init__(self, torch: Any, dist: Any, args: Any, device: Any, adapt: bool) -> None:
        self.torch, self.dist, self.args, self.device, self.adapt = torch, dist, args, device, adapt
        self.full = max(int(args.pair_mb * 262144), 1)
        self.rates: dict[int, float] = {}
        self.sizes: dict[int, int] = {}
        self._bufs: dict[int, Any] = {}  # by round (-1: the probe's): the last size only
        cuda = getattr(device, "type", "cpu") == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(device)) if cuda else _nothing

    def probe(self) -> None:
        """The first exchange with every partner (best of two), which sizes the first
        measurement's buffer."""
        if not self.adapt:
            return
        for r, partner in self._partners():
            for _ in range(2):
                self._seen(r, self._ping_pong(self._buf(-1, PROBE_FLOATS), partner, 1))

    def repeat(self) -> float:
        """One ping-pong with each partner of the pairing rounds; the best MB/s (0: none)."""
        best = 0.0
        for r, partner in self._partners():
            buf = self._buf(r, self._agree(r, partner))
            figure = self._ping_pong(buf, partner, self.args.pair_iterations)
            self._seen(r, figure)
            best = max(best, figure)
        return best

    def slowest(self) -> float:
        """Bytes/s of the slowest link of all pods (each link at its best); infinite with no
        pairs. A collective: every pod calls it."""
        mine = min(self.rates.values(), default=math.inf)
        found = self.torch.tensor([mine], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(found, op=self.dist.ReduceOp.MIN)
        return float(found.item())

    def _partners(self) -> Iterator[tuple[int, int]]:
        """(round, partner) for each pairing round this pod has a partner in; every pod passes
        the barrier that starts each round."""
        for r in range(rounds(self.args.world_size, self.args.max_pair_rounds)):
            self.dist.barrier()
            partner = pairing(self.args.world_size, r).get(self.args.rank)
            if partner is not None:
                yield r, partner

    def _agree(self, r: int, partner: int) -> int:
        """The buffer's float32s for this measurement of round ``r``'s link: sized by the lower
        rank from the link's best rate so far, sent to the partner."""
        if not self.adapt:
            return self.full
        size = pair_floats(self.args, self.rates.get(r, math.inf))
        said = self.torch.tensor([size], dtype=self.torch.int64, device=self.device)
        if self.args.rank < partner:
            self.dist.send(said, partner)
        else:
            self.dist.recv(said, partner)
        self.sizes[r] = int(said.item())
        return self.sizes[r]

    def _seen(self, r: int, mb_s: float) -> None:
        self.rates[r] = max(self.rates.get(r, 0.0), mb_s * 1e6)

    def _buf(self, key: int, floats: int) -> Any:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() != floats:
            buf = self._bufs[key] = self.torch.zeros(floats, dtype=self.torch.float32,
                                                     device=self.device)  # fmt: skip
        return buf

    def _ping_pong(self, buf: Any, partner: int, iterations: int) -> float:
        return ping_pong(self.dist, buf, self.args.rank, partner, iterations, self.sync)
