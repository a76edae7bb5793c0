"""The real ``Bus`` and ``StatusStore``: nats-py on a NATS server, JetStream KV for status.

A URL may list several servers of one cluster, comma-separated: the client is given them all and
reconnects to a survivor when its server dies. On a cluster the KV buckets are replicated
(``replicas``); while a bucket elects a new leader after a server died (seconds), a write times out
or finds no responder: ``KvStore.put`` tries again until ``retry_s``, and a retried write that
finds its own bytes already stored (the first try landed, its ack was lost) counts as done.
With ``tls_ca`` the client trusts that CA only (a server that requires TLS is met with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import (
    ConnectionClosedError,
    ConnectionReconnectingError,
    NoRespondersError,
    NoServersError,
)
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)

from aegis.adapters import tls
from aegis.adapters.aio import cancellable, cancellations, raise_if_cancelled
from aegis.adapters.nats_auth import UserCreds
from aegis.adapters.nats_text import RepeatGate, server_list
from aegis.adapters.ports import Handler, StoreConflictError
from aegis.core.errors import AegisError

log = logging.getLogger(__name__)

# What a JetStream request raises while its stream (or the cluster) elects a new leader.
TRANSIENT = (
    NatsTimeoutError,
    TimeoutError,
    NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ConnectionReconnectingError,
)


async def _key_value(js: Any, bucket: str, replicas: int) -> Any:
    try:  # (a create whose reply was lost is answered as done the second time)
        return await js.key_value(bucket)
    except TRANSIENT:
        raise
    except Exception:  # bucket missing: create it
        return await js.create_key_value(bucket=bucket, history=1, replicas=replicas)


class NatsSubscription:
    def __init__(self, sub: object) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()  # type: ignore[attr-defined]


class BusClosedError(AegisError, ConnectionError):
    """The connection is closed for good (e.g. the server closed it when its credentials
    expired): nothing more goes out on it."""


@contextlib.contextmanager
def errors_unlogged() -> Iterator[None]:
    """For a one-shot command that reports the connection's error itself, once."""
    quiet = logging.getLogger(__name__)
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        yield
    finally:
        quiet.setLevel(level)


def error_text(exc: BaseException) -> str:
    """What the server said, without nats-py's wrapping: ``nats: 'Authorization Violation'``
    -> ``Authorization Violation``."""
    text = str(exc).strip().removeprefix("nats:").strip(" '\"")
    return text or type(exc).__name__


class NatsBus:
    """A connected nats-py client. Reconnects forever; errors (e.g. permission violations) are
    logged and passed to ``on_error``. A connection that closes for good without ``close`` (the
    server closes it when the credentials expire, and says nothing else) is passed to
    ``on_closed``."""

    def __init__(self, client: Client, url: str = "", creds: UserCreds | None = None) -> None:
        self.client = client
        self.url, self.creds = url, creds  # what it connected with (for the control file)
        self.closing = False  # close() was called: a closed connection is expected

    @classmethod
    async def connect(
        cls,
        url: str,
        creds: UserCreds | None = None,
        *,
        name: str = "aegis",
        on_error: Callable[[Exception], None] | None = None,
        on_closed: Callable[[], None] | None = None,
        connect_timeout_s: float = 5.0,
        max_reconnect_attempts: int = -1,
        tls_ca: Path | None = None,
    ) -> NatsBus:
        made: list[NatsBus] = []
        repeats = RepeatGate()

        async def error_cb(exc: Exception) -> None:
            if (line := repeats.say(str(exc), time.monotonic())) is not None:
                log.warning("nats %s: %s", name, line)
            if on_error is not None:
                on_error(exc)

        async def closed_cb() -> None:
            if made and not made[0].closing:
                log.warning("nats %s: the connection closed for good", name)
                if on_closed is not None:
                    on_closed()

        options: dict[str, object] = {
            "servers": server_list(url),
            "name": name,
            "connect_timeout": connect_timeout_s,
            "reconnect_time_wait": 0.25,
            # nats-py reads 0 as "no limit" (it retries a dead server for ever, even on the
            # first connect): 0 here means one more try at most, and no reconnecting later.
            "max_reconnect_attempts": max_reconnect_attempts or 1,
            "error_cb": error_cb,
            "closed_cb": closed_cb,
            "allow_reconnect": max_reconnect_attempts != 0,
        }
        if creds is not None and creds.jwt:
            options["user_jwt_cb"] = creds.jwt_bytes
            options["signature_cb"] = creds.sign_nonce
            options["inbox_prefix"] = creds.inbox_prefix.encode()
        if tls_ca is not None:
            options["tls"] = tls.client_context(tls_ca)
        try:  # a cancellation ends the wait, whatever nats-py's retry loop does with it
            client = await cancellable(nats.connect(**options), Client.close)  # type: ignore[arg-type]
        except NoServersError as exc:  # every server refused (and no reconnecting for ever)
            raise ConnectionRefusedError(f"no NATS server answers at {url}") from exc
        made.append(cls(client, url, creds))
        return made[0]

    @property
    def connected(self) -> bool:
        return bool(self.client.is_connected)

    async def publish(self, subject: str, payload: bytes) -> None:
        try:
            await self.client.publish(subject, payload)
        except ConnectionClosedError as exc:
            raise BusClosedError(f"not sent on {subject}: the connection is closed") from exc

    async def subscribe(self, subject: str, handler: Handler) -> NatsSubscription:
        async def on_message(msg: Msg) -> None:
            await handler(msg.subject, msg.data)

        return NatsSubscription(await self.client.subscribe(subject, cb=on_message))

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Return once everything sent before it has reached the server. nats-py's own flush
        writes its PING straight to the socket, ahead of the commands still queued for its
        flusher task: its PONG could come back before a SUB just made had left, and a message
        another client published next was lost (about one in 40 here). So the queue is
        written out first (nats-py has no public call for that: should a later nats-py lose
        the private one, the contract test says whether its flush still needs it), then the
        PING goes (``_round_trip``)."""
        write_out = getattr(self.client, "_flush_pending", None)
        if write_out is not None:
            async with asyncio.timeout(timeout_s):
                await write_out(force_flush=True)
        await self._round_trip(timeout_s)

    async def _round_trip(self, timeout_s: float) -> None:
        """A PING and its PONG within ``timeout_s`` (``TimeoutError`` otherwise). nats-py's own
        flush cancels its PONG's future when it times out; the late PONG then raises
        ``InvalidStateError`` in the connection's read loop, which ends for good: no reconnect,
        nothing heard again, and every later flush "succeeds" without a round trip (nats-py
        2.16; found when a master checked its bus on a hung server). The future here is left
        for the PONG."""
        send_ping = getattr(self.client, "_send_ping", None)
        if send_ping is None:  # a later nats-py without it: its own flush
            await self.client.flush(timeout=max(1, round(timeout_s)))
            return
        if self.client.is_closed:
            raise ConnectionClosedError
        reading = getattr(self.client, "_reading_task", None)
        if reading is not None and reading.done():  # nothing would read the PONG
            raise BusClosedError("the connection's read loop has ended")
        queue = getattr(self.client, "_flush_queue", None)
        if not self.client.is_connected or (queue is not None and queue.full()):
            raise TimeoutError("nats: reconnecting, or nothing written out")  # as a flush would
        pong: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await send_ping(pong)
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(pong)  # a timeout cancels the wait, not the future

    async def close(self) -> None:
        """Close the connection; one already lost (its server gone) has nothing left to flush."""
        self.closing = True
        if not self.client.is_closed:
            try:
                await self.client.close()
            except OSError as exc:
                log.info("nats %s: closed with the connection lost (%s)", self.url, exc)


class KvStore:
    """A JetStream KV bucket; revision-checked writes, retried through a cluster failover."""

    def __init__(
        self,
        kv: object,
        *,
        retry_s: float = 30.0,
        client: Client | None = None,
        request_timeout_s: float = 2.0,
    ) -> None:
        self._kv = kv
        self.retry_s = retry_s
        self.bucket = str(kv._name)  # type: ignore[attr-defined]
        js = kv._js  # type: ignore[attr-defined]
        self._client: Client = client if client is not None else js._nc
        self._api = str(getattr(js, "_prefix", "$JS.API"))
        self.request_timeout_s = request_timeout_s

    @classmethod
    async def open(
        cls,
        bus: NatsBus,
        bucket: str,
        *,
        replicas: int = 1,
        retry_s: float = 30.0,
        request_timeout_s: float = 2.0,
    ) -> KvStore:
        """The bucket, created when missing; asked again until ``retry_s`` while JetStream
        cannot answer (a cluster electing its leaders: one 2-s timeout failed a run's start)."""
        js = bus.client.jetstream(timeout=request_timeout_s)
        deadline, since = time.monotonic() + retry_s, cancellations()
        while True:
            try:
                kv = await _key_value(js, bucket, replicas)
                break
            except TRANSIENT as exc:
                raise_if_cancelled(since)
                if time.monotonic() > deadline:
                    raise
                log.warning("kv %s: opening failed (%s), trying again", bucket, type(exc).__name__)
                await asyncio.sleep(0.2)
        return cls(kv, retry_s=retry_s, client=bus.client, request_timeout_s=request_timeout_s)

    @classmethod
    async def existing(
        cls, bus: NatsBus, bucket: str, *, retry_s: float = 30.0, request_timeout_s: float = 2.0
    ) -> KvStore | None:
        """The bucket if it exists (a reader's view: nothing is created), else None."""
        js = bus.client.jetstream(timeout=request_timeout_s)
        try:
            kv = await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            return None
        return cls(kv, retry_s=retry_s, client=bus.client, request_timeout_s=request_timeout_s)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        return await self._get_retrying(key, time.monotonic() + self.retry_s)

    async def _get_once(self, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await self._kv.get(key)  # type: ignore[attr-defined]
        except KeyNotFoundError:
            return None
        return bytes(entry.value or b""), int(entry.revision)

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        deadline = time.monotonic() + self.retry_s
        retried, since = False, cancellations()
        while True:
            try:
                if expected_revision is None:
                    revision = int(await self._kv.create(key, value))  # type: ignore[attr-defined]
                else:
                    revision = int(await self._kv.update(key, value, last=expected_revision))  # type: ignore[attr-defined]
                raise_if_cancelled(since)  # written, and the reply swallowed our cancellation
                return revision
            except KeyWrongLastSequenceError as exc:
                if retried:  # did the try whose ack was lost land? then it is done
                    stored = await self._get_retrying(key, deadline)
                    if stored is not None and stored[0] == value:
                        return stored[1]
                raise StoreConflictError("conflict", detail=f"{key}: {exc}") from None
            except TRANSIENT as exc:
                raise_if_cancelled(since)
                if time.monotonic() > deadline:
                    raise
                log.warning("kv %s: write failed (%s), trying again", key, type(exc).__name__)
                retried = True
                await asyncio.sleep(0.2)

    async def _get_retrying(self, key: str, deadline: float) -> tuple[bytes, int] | None:
        since = cancellations()
        while True:
            try:
                found = await self._get_once(key)
                raise_if_cancelled(since)  # (as in ``put``)
                return found
            except TRANSIENT:
                raise_if_cancelled(since)
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def keys(self) -> list[str]:
        """Every key the bucket holds a record for, sorted.

        Read from the stream's subject index (``STREAM.INFO`` with a subjects filter; the server
        pages it, 100,000 subjects a page): no consumer is made, however often it is called. (A
        watcher per call left an ephemeral consumer for 300 s; the stream's 1,000th made every
        later call fail.) A key deleted from outside Aegis (``nats kv del``) is still listed
        (its delete marker is a subject too); its ``get`` is None."""
        prefix = f"$KV.{self.bucket}."
        found: set[str] = set()
        offset = 0
        while True:
            subjects, total = await self._subjects_page(f"{prefix}>", offset)
            found.update(subject.removeprefix(prefix) for subject in subjects)
            offset += len(subjects)
            if not subjects or offset >= total:
                return sorted(found)

    async def remove(self, key: str, revision: int) -> bool:
        """Purge the key's messages up to ``revision`` from the stream (``STREAM.PURGE`` with a
        subject filter and a sequence bound): no delete marker stays behind, so ``keys`` stops
        listing it. A newer revision is past the bound and stays (False)."""
        request = {"filter": f"$KV.{self.bucket}.{key}", "seq": revision + 1}
        await self._stream_api("PURGE", request)
        return await self._get_once(key) is None

    async def _subjects_page(self, subjects_filter: str, offset: int) -> tuple[list[str], int]:
        """One page of the stream's subjects (sorted by the server when paged) and how many
        there are in all. Raises what a JetStream request raises (``TRANSIENT`` included)."""
        reply = await self._stream_api(
            "INFO", {"subjects_filter": subjects_filter, "offset": offset}
        )
        subjects = (reply.get("state") or {}).get("subjects") or {}
        return list(subjects), int(reply.get("total") or 0)

    async def _stream_api(self, verb: str, request: dict[str, Any]) -> dict[str, Any]:
        """One request to the JetStream API about the bucket's stream; its reply, or the error's
        own class raised (503: transient)."""
        msg = await self._client.request(
            f"{self._api}.STREAM.{verb}.KV_{self.bucket}",
            json.dumps(request).encode(),
            timeout=self.request_timeout_s,
        )
        reply = json.loads(msg.data)
        if "error" in reply:
            APIError.from_error(reply["error"])
        return dict(reply)
