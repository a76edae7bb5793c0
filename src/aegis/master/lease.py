"""Leader election on a lease store (``adapters.ports.LeaseStore``): one key with a TTL.

The store is a JetStream KV bucket in production (``adapters.nats_lease``) and a fake in
memory for tests (``adapters.memory.MemoryLeaseStore``); the same contract suite runs on both.
This module holds the election's logic: acquire a vacant key, renew it before it expires, and
as a standby, wait for a vacancy and try again (also on a timer, in case a watch event is
missed).

The revision at acquisition is the leader's *epoch*. The lease is held while a renewal
succeeded within ``lease_s - margin_s`` by this process's clock (``lease_clock``: it counts a
suspended machine's time too): a leader that was stopped (SIGSTOP) or suspended past its lease
finds it expired on its own clock before doing anything.

Lease length: 2 s on a single server. On a JetStream cluster (R3 buckets) a server's death makes
the lease bucket elect a new stream leader, during which no renewal can succeed: 4.4-6.7 s
measured on a loopback R3 cluster (raft election timeouts of 4-9 s), so the clustered default is
12 s (the longest election, one renewal period and the margin fit in it). A renewal is attempted
every ``renew_s`` (at most 1 s), and again every 0.2 s after a failure, so the first write the
new stream leader accepts renews the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client

from aegis.adapters.aio import cancellations, raise_if_cancelled
from aegis.adapters.nats_lease import NatsLeaseStore
from aegis.adapters.ports import LeaseStore, LeaseTakenError

log = logging.getLogger(__name__)


SINGLE_SERVER_LEASE_S = 2.0
CLUSTER_LEASE_S = 12.0
RETRY_AFTER_FAILURE_S = 0.2


def lease_clock() -> float:
    """The clock a lease is judged by: one that goes on while the machine is suspended
    (``CLOCK_BOOTTIME``; ``time.monotonic`` stops then, and a leader resumed after its lease ran
    out believed it until its next renewal was refused); ``time.monotonic`` where there is none."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)  # Linux


TOKEN_MARK = "#"  # the lease's value: the holder's name, this mark, a token of its Lease


def holder_name(value: str) -> str:
    """The replica's name in a lease's value (what an older replica wrote is the name alone)."""
    return value.split(TOKEN_MARK, 1)[0]


def default_lease_s(replicas: int) -> float:
    """The default lease for buckets of ``replicas`` copies: longer than a cluster failover."""
    return CLUSTER_LEASE_S if replicas > 1 else SINGLE_SERVER_LEASE_S


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    lease_s: float = SINGLE_SERVER_LEASE_S
    bucket: str = "aegis-leader"
    key: str = "leader"
    margin_s: float = 0.3
    replicas: int = 1
    renew_s: float | None = None  # None: a third of the lease, at most 1 s

    @classmethod
    def for_replicas(cls, replicas: int, lease_s: float | None = None) -> LeaseSettings:
        """Settings for buckets of ``replicas`` copies; ``lease_s`` None: the default for it."""
        return cls(lease_s=lease_s or default_lease_s(replicas), replicas=replicas)

    @property
    def renew_every_s(self) -> float:
        return self.renew_s if self.renew_s is not None else min(self.lease_s / 3, 1.0)


def nats_lease(client: Client, holder: str, settings: LeaseSettings) -> Lease:
    """The production lease: on the JetStream bucket ``settings.bucket``."""
    store = NatsLeaseStore(
        client,
        bucket=settings.bucket,
        key=settings.key,
        replicas=settings.replicas,
        ttl_s=settings.lease_s,
    )
    return Lease(store, holder, settings)


class Lease:
    def __init__(
        self,
        store: LeaseStore,
        holder: str,
        settings: LeaseSettings,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.store, self.holder, self.settings = store, holder, settings
        self.clock = clock or lease_clock
        # What this Lease writes on the key: the holder's name and a token of this instance, so a
        # second replica given the same name (a restarted container is often the same host and
        # PID) never takes this one's write for its own (``_own_revision``).
        self.token = f"{holder}{TOKEN_MARK}{secrets.token_hex(6)}"
        self.epoch: int | None = None
        self._revision = 0
        self._valid_until = 0.0
        self.renew_failures = 0  # consecutive failed renewals (a cluster failover)

    async def open(self) -> None:
        await self.store.open()

    @property
    def held(self) -> bool:
        return self.epoch is not None and self.clock() < self._valid_until

    async def try_acquire(self) -> bool:
        started = self.clock()
        try:
            expected = await self._vacant_or_own()
            if expected is None:
                return False
            revision = await self._write(expected=expected)
        except LeaseTakenError:
            return False
        except Exception as exc:  # a JetStream hiccup (cluster failover): try again later
            log.debug("lease: acquire failed: %s", exc)
            return False
        self.epoch = self._revision = revision
        self._valid_until = started + self.settings.lease_s - self.settings.margin_s
        log.info("lease: %s is leader (epoch %d)", self.holder, revision)
        return True

    async def renew(self) -> bool:
        """Extend the lease; False when it is lost (someone else holds it or it expired)."""
        if not self.held:
            self.epoch = None
            return False
        started = self.clock()
        try:
            self._revision = await self._renewal()
        except LeaseTakenError:  # another holder wrote the key: lost for good, whatever the clock
            log.warning("lease: %s was taken over (epoch %s)", self.holder, self.epoch)
            self.epoch = None
            return False
        except Exception as exc:
            self.renew_failures += 1
            level = logging.WARNING if self.renew_failures == 1 else logging.DEBUG
            log.log(level, "lease: renewal failed: %s", type(exc).__name__)
            if not self.held:
                self.epoch = None
            return self.held
        if self.renew_failures:
            log.info("lease: renewed after %d failed tries", self.renew_failures)
            self.renew_failures = 0
        self._valid_until = started + self.settings.lease_s - self.settings.margin_s
        return True

    async def _own_revision(self) -> int | None:
        """The revision of the live lease when it carries this holder's name: a write of ours
        took effect though its answer was lost (a timeout in a cluster's failover). Only this
        holder writes its name, so the key is still ours; None when it is vacant or another's."""
        found = await self.store.holder()
        if found is None or found[0] != self.token:
            return None
        log.info("lease: %s's write at revision %d took effect unanswered", self.holder, found[1])
        return found[1]

    async def _vacant_or_own(self) -> int | None:
        """The revision to acquire over: a vacant key's, or this holder's own lease (an
        acquisition whose answer was lost); None when another holds it."""
        try:
            return await self.store.vacant_revision()
        except LeaseTakenError:
            return await self._own_revision()

    async def _renewal(self) -> int:
        """Renew over the last revision this holder knows of, or over its own later write whose
        answer was lost (otherwise the lead would end on a lost answer)."""
        try:
            return await self._write(expected=self._revision)
        except LeaseTakenError:
            own = await self._own_revision()
            if own is None or own <= self._revision:
                raise
            return await self._write(expected=own)

    async def _write(self, *, expected: int) -> int:
        return await self.store.write(
            self.token,
            expected=expected,
            ttl_s=self.settings.lease_s,
            timeout_s=max(0.2, self.settings.renew_every_s),
        )

    async def keep(self) -> None:
        """Renew until the lease is lost (soon again after a failure); then return."""
        since = cancellations()
        while True:
            raise_if_cancelled(since)
            failing = self.renew_failures > 0
            await asyncio.sleep(RETRY_AFTER_FAILURE_S if failing else self.settings.renew_every_s)
            if not await self.renew():
                log.warning("lease: %s lost the lead (epoch %s)", self.holder, self.epoch)
                self.epoch = None
                return

    async def wait_for_lead(self) -> int:
        """Until this replica holds the lease; returns the epoch."""
        since = cancellations()
        try:
            while not await self.try_acquire():
                raise_if_cancelled(since)
                await self.store.wait_vacancy(min(self.settings.lease_s / 2, 2.0))
        finally:
            await self.store.stop_watching()
        raise_if_cancelled(since)  # won, but asked to stop meanwhile: run's finally releases
        assert self.epoch is not None
        return self.epoch

    async def release(self) -> None:
        """Give the lease up now (a clean shutdown): standbys take over at once. Only the key
        as this holder last wrote it is removed: never a successor's lease. After a renewal
        whose answer was lost, that is the later write of this holder's own (``_own_revision``);
        otherwise the removal was refused and the standbys waited out the TTL."""
        if self.epoch is None:
            return
        with contextlib.suppress(Exception):
            try:
                await self.store.remove(expected=self._revision)
            except LeaseTakenError:
                own = await self._own_revision()
                if own is not None and own > self._revision:
                    await self.store.remove(expected=own)
        self.epoch = None
