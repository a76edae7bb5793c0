"""For the tests of a master's polling of its buckets: a standalone master (``Replica``) on a real
nats-server, a count of its polls (``KvStore.keys`` calls, by the task that made them: ``jobs``
is the leader's adoption poll, ``records`` every replica's refresh) and of the consumers on
each of its buckets' streams."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.nats_server import EmbeddedNats
from aegis.core.retention import KEEP_ENDED_S
from aegis.master import drained_nodes
from aegis.master.lease import LeaseSettings
from aegis.master.replica import Replica, ReplicaSettings
from aegis.master.service import STATUS_BUCKET

BUCKETS = (STATUS_BUCKET, drained_nodes.BUCKET, LeaseSettings().bucket)


@dataclass
class Polls:
    """``started``/``failed``: ``keys`` calls by task name. ``first_listed``: key -> the index
    (in ``started["jobs"]``) of the first adoption poll that listed it; ``adopted_at``: key ->
    the index of the adoption poll that adopted it."""

    started: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    first_listed: dict[str, int] = field(default_factory=dict)
    adopted_at: dict[str, int] = field(default_factory=dict)


def count_polls(monkeypatch: pytest.MonkeyPatch) -> Polls:
    """Counts ``KvStore.keys`` calls; ``adopted`` is for the replica's ``adopted`` hook."""
    polls = Polls()
    keys = KvStore.keys

    async def counted_keys(self: KvStore) -> list[str]:
        task = asyncio.current_task()
        name = task.get_name() if task is not None else ""
        polls.started[name] += 1
        index = polls.started[name]
        try:
            found = await keys(self)
        except Exception:
            polls.failed[name] += 1
            raise
        if name == "jobs":
            for key in found:
                polls.first_listed.setdefault(key, index)
        return found

    monkeypatch.setattr(KvStore, "keys", counted_keys)
    return polls


async def consumer_counts(bus: NatsBus) -> dict[str, int]:
    """The number of consumers on each of the master's buckets' streams (0: no such bucket)."""
    js = bus.client.jetstream()
    counts: dict[str, int] = {}
    for bucket in BUCKETS:
        try:
            info = await js.stream_info(f"KV_{bucket}")
        except Exception:  # not made yet
            counts[bucket] = 0
            continue
        counts[bucket] = info.state.consumer_count
    return counts


@dataclass
class Master:
    server: EmbeddedNats
    replica: Replica
    bus: NatsBus  # the test's own connection (a submitter's)
    store: KvStore  # the status bucket, through ``bus``
    polls: Polls


# No failover is meant with these masters: a loaded machine's stall of a few seconds must not
# hand the lead to a standby (the failover tests kill the leader on purpose, elsewhere).
LEASE_S = 10.0


@contextlib.asynccontextmanager
async def standalone_master(
    monkeypatch: pytest.MonkeyPatch,
    poll_s: float,
    keep_ended_s: float = KEEP_ENDED_S,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncIterator[Master]:
    """A nats-server and one master replica on it, leading (it holds the lease); ``clock``:
    the replica's for ended jobs' retention."""
    polls = count_polls(monkeypatch)
    server = EmbeddedNats(None)
    await asyncio.to_thread(server.start)
    replica = Replica(None, server.url, ReplicaSettings(
        replica_id="m1", lease=LeaseSettings(lease_s=LEASE_S), poll_s=poll_s,
        keep_ended_s=keep_ended_s, clock=clock))  # fmt: skip
    replica.adopted.append(lambda key: polls.adopted_at.setdefault(key, polls.started["jobs"]))
    task = asyncio.create_task(replica.run(), name="replica")
    bus = await NatsBus.connect(server.url)
    try:
        async with asyncio.timeout(60):
            await replica.leading.wait()
        yield Master(server, replica, bus, await KvStore.open(bus, STATUS_BUCKET), polls)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await bus.close()
        await asyncio.to_thread(server.stop)


def leads(master: Master, key: str) -> bool:
    """The master leads the job: its loop runs, its platform's events reach it (a job is in
    ``runners`` a moment before its platform-events subscription is made)."""
    runner = master.replica.runners.get(key)
    return runner is not None and runner.task is not None
