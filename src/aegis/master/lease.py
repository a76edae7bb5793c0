"""Leader election on a JetStream KV bucket: one lease key with a per-key TTL.

- acquire: ``create`` the key with a message TTL (the bucket has limit markers, so the server
  places a delete marker when the TTL expires);
- renew: a publish with ``Nats-Expected-Last-Subject-Sequence`` (our last revision) and
  ``Nats-TTL``; nats-py's ``update`` cannot set a TTL, so the publish is made directly;
- standby: watch the key and try ``create`` when the marker appears (and on a timer, in case a
  watch event is missed).

The revision at acquisition is the leader's *epoch*. The lease is held while a renewal
succeeded within ``lease_s - margin_s`` by this process's monotonic clock: a leader that was
stopped (SIGSTOP) past its lease finds it expired on its own clock before doing anything.

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
import time
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from aegis.adapters.aio import cancellations, raise_if_cancelled
from aegis.core.errors import AegisError

log = logging.getLogger(__name__)


SINGLE_SERVER_LEASE_S = 2.0
CLUSTER_LEASE_S = 12.0
RETRY_AFTER_FAILURE_S = 0.2


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


class _OccupiedError(AegisError):
    pass


class Lease:
    def __init__(self, client: Client, holder: str, settings: LeaseSettings) -> None:
        self.client, self.holder, self.settings = client, holder, settings
        self.kv: KeyValue | None = None
        self.epoch: int | None = None
        self._revision = 0
        self._valid_until = 0.0
        self.renew_failures = 0  # consecutive failed renewals (a cluster failover)
        # One watcher for a standby's whole wait (each watcher is a JetStream consumer that
        # outlives its stop by minutes: one per try filled the bucket with them).
        self._watcher: KeyValue.KeyWatcher | None = None
        self.watchers_opened = 0

    async def open(self) -> None:
        js = self.client.jetstream()
        try:
            self.kv = await js.key_value(self.settings.bucket)
        except NotFoundError:
            self.kv = await js.create_key_value(
                bucket=self.settings.bucket,
                history=1,
                limit_marker_ttl=max(1.0, self.settings.lease_s),
                replicas=self.settings.replicas,
                storage=api.StorageType.FILE,
            )

    @property
    def held(self) -> bool:
        return self.epoch is not None and time.monotonic() < self._valid_until

    async def try_acquire(self) -> bool:
        assert self.kv is not None
        started = time.monotonic()
        try:
            revision = await self._publish(expected=await self._vacant_revision())
        except (KeyWrongLastSequenceError, _OccupiedError):
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
        assert self.kv is not None
        if not self.held:
            self.epoch = None
            return False
        started = time.monotonic()
        try:
            self._revision = await self._publish(expected=self._revision)
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

    async def _publish(self, *, expected: int) -> int:
        """Write the lease with a TTL if the key is still at revision ``expected``."""
        headers = {str(api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value): str(expected)}
        ack = await self.client.jetstream().publish(
            self._subject,
            self.holder.encode(),
            headers=headers,
            msg_ttl=self.settings.lease_s,
            timeout=max(0.2, self.settings.renew_every_s),
        )
        return int(ack.seq)

    @property
    def _subject(self) -> str:
        return f"$KV.{self.settings.bucket}.{self.settings.key}"

    async def _vacant_revision(self) -> int:
        """The revision to overwrite when nobody holds the lease (0: never held); raises
        ``_OccupiedError`` when a live lease is there. The server's TTL delete marker counts as
        vacant (nats-py's ``create`` does not see it as a deletion)."""
        stream = f"KV_{self.settings.bucket}"
        try:
            last = await self.client.jetstream().get_last_msg(stream, self._subject)
        except NotFoundError:
            return 0
        headers = last.headers or {}
        if headers.get("Nats-Marker-Reason") or headers.get("KV-Operation") in ("DEL", "PURGE"):
            return int(last.seq or 0)
        raise _OccupiedError

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
        assert self.kv is not None
        since = cancellations()
        try:
            while not await self.try_acquire():
                raise_if_cancelled(since)
                await self._wait_vacancy(min(self.settings.lease_s / 2, 2.0))
        finally:
            await self._stop_watching()
        raise_if_cancelled(since)  # won, but asked to stop meanwhile: run's finally releases
        assert self.epoch is not None
        return self.epoch

    async def _wait_vacancy(self, timeout_s: float) -> None:
        """Until the lease is deleted or expires (its marker), or ``timeout_s``, on the one
        watcher of this wait (opened on first use, again only after it failed)."""
        assert self.kv is not None
        if self._watcher is None:
            try:
                self._watcher = await self.kv.watch(self.settings.key, include_history=False)
                self.watchers_opened += 1
            except Exception as exc:  # the bucket is electing a leader (a cluster failover)
                log.debug("lease: cannot watch yet: %s", exc)
                await asyncio.sleep(RETRY_AFTER_FAILURE_S)
                return
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await self._watcher.updates(timeout=left)  # type: ignore[no-untyped-call]
            except (nats.errors.TimeoutError, TimeoutError):
                return
            except Exception as exc:  # the watcher broke: a new one on the next wait
                log.debug("lease: watching failed: %s", exc)
                await self._stop_watching()
                return
            if entry is not None and entry.operation in ("DEL", "PURGE"):
                return

    async def _stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    async def release(self) -> None:
        """Give the lease up now (a clean shutdown): standbys take over at once."""
        if self.kv is None or self.epoch is None:
            return
        with contextlib.suppress(Exception):
            await self.kv.purge(self.settings.key)
        self.epoch = None
