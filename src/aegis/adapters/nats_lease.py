"""The lease port on a JetStream KV bucket: one key with a per-message TTL.

- acquire: a publish expecting the key's last revision (0: never written), with a TTL; the
  bucket has limit markers, so the server places a delete marker when the TTL expires;
- renew: the same publish expecting our own last revision (nats-py's ``update`` cannot set a
  TTL, so the publish is made directly);
- a standby watches the key and tries again when the marker appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
from nats.aio.client import Client
from nats.js import api
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from aegis.adapters.ports import LeaseTakenError

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check
RETRY_WATCH_S = 0.2  # a watch that could not be opened (a stream leader election)


class NatsLeaseStore:
    def __init__(
        self, client: Client, *, bucket: str, key: str, replicas: int, ttl_s: float
    ) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.replicas, self.ttl_s = replicas, ttl_s
        self.kv: KeyValue | None = None
        # One watcher for a standby's whole wait (each watcher is a JetStream consumer that
        # outlives its stop by minutes: one per try filled the bucket with them).
        self._watcher: KeyValue.KeyWatcher | None = None
        self.watchers_opened = 0

    async def open(self) -> None:
        js = self.client.jetstream()
        try:
            self.kv = await js.key_value(self.bucket)
        except NotFoundError:
            self.kv = await js.create_key_value(
                bucket=self.bucket,
                history=1,
                limit_marker_ttl=max(1.0, self.ttl_s),
                replicas=self.replicas,
                storage=api.StorageType.FILE,
            )

    @property
    def _subject(self) -> str:
        return f"$KV.{self.bucket}.{self.key}"

    async def _last(self) -> tuple[str | None, int]:
        """The key's live holder (None when vacant) and its last revision. The server's TTL
        delete marker counts as vacant (nats-py's ``create`` does not see it as a deletion)."""
        try:
            last = await self.client.jetstream().get_last_msg(f"KV_{self.bucket}", self._subject)
        except NotFoundError:
            return None, 0
        headers = last.headers or {}
        if headers.get("Nats-Marker-Reason") or headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None, int(last.seq or 0)
        return (last.data or b"").decode(errors="replace"), int(last.seq or 0)

    async def vacant_revision(self) -> int:
        holder, revision = await self._last()
        if holder is not None:
            raise LeaseTakenError("lease held", detail=self.key)
        return revision

    async def holder(self) -> tuple[str, int] | None:
        holder, revision = await self._last()
        return None if holder is None else (holder, revision)

    async def write(self, holder: str, *, expected: int, ttl_s: float, timeout_s: float) -> int:
        headers = {str(api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value): str(expected)}
        try:
            ack = await self.client.jetstream().publish(
                self._subject, holder.encode(), headers=headers, msg_ttl=ttl_s, timeout=timeout_s
            )
        except BadRequestError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            raise LeaseTakenError("lease moved on", detail=f"{self.key}: {exc}") from exc
        return int(ack.seq)

    async def wait_vacancy(self, timeout_s: float) -> None:
        assert self.kv is not None, "open() first"
        if self._watcher is None:
            try:
                self._watcher = await self.kv.watch(self.key, include_history=False)
                self.watchers_opened += 1
            except Exception as exc:  # the bucket is electing a leader (a cluster failover)
                log.debug("lease: cannot watch yet: %s", exc)
                await asyncio.sleep(RETRY_WATCH_S)
                return
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await self._watcher.updates(timeout=left)  # type: ignore[no-untyped-call]
            except (nats.errors.TimeoutError, TimeoutError):
                return
            except Exception as exc:  # the watcher broke: a new one on the next wait
                log.debug("lease: watching failed: %s", exc)
                await self.stop_watching()
                return
            if entry is not None and entry.operation in ("DEL", "PURGE"):
                return

    async def stop_watching(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    @property
    def watching(self) -> bool:
        return self._watcher is not None

    async def remove(self, expected: int) -> None:
        if self.kv is None:
            return
        try:
            await self.kv.delete(self.key, last=expected)  # a DEL marker: vacant to all
        except BadRequestError as exc:
            if exc.err_code != WRONG_LAST_SEQUENCE:
                raise
            raise LeaseTakenError("lease moved on", detail=f"{self.key}: {exc}") from exc
