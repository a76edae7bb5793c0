"""The real ``Bus`` and ``StatusStore``: nats-py on a NATS server, JetStream KV for status."""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from aegis.adapters.nats_auth import UserCreds
from aegis.adapters.ports import Handler, StoreConflict

log = logging.getLogger(__name__)


class NatsSubscription:
    def __init__(self, sub: object) -> None:
        self._sub = sub

    async def unsubscribe(self) -> None:
        await self._sub.unsubscribe()  # type: ignore[attr-defined]


class NatsBus:
    """A connected nats-py client. Reconnects forever; errors (e.g. permission violations) are
    logged and passed to ``on_error``."""

    def __init__(self, client: Client, url: str = "", creds: UserCreds | None = None) -> None:
        self.client = client
        self.url, self.creds = url, creds  # what it connected with (for the control file)

    @classmethod
    async def connect(
        cls,
        url: str,
        creds: UserCreds | None = None,
        *,
        name: str = "aegis",
        on_error: Callable[[Exception], None] | None = None,
        connect_timeout_s: float = 5.0,
        max_reconnect_attempts: int = -1,
    ) -> NatsBus:
        async def error_cb(exc: Exception) -> None:
            log.warning("nats %s: %s", name, exc)
            if on_error is not None:
                on_error(exc)

        options: dict[str, object] = {
            "servers": [url],
            "name": name,
            "connect_timeout": connect_timeout_s,
            "reconnect_time_wait": 0.25,
            "max_reconnect_attempts": max_reconnect_attempts,
            "error_cb": error_cb,
            "allow_reconnect": True,
        }
        if creds is not None and creds.jwt:
            options["user_jwt_cb"] = creds.jwt_bytes
            options["signature_cb"] = creds.sign_nonce
            options["inbox_prefix"] = creds.inbox_prefix.encode()
        client = await nats.connect(**options)  # type: ignore[arg-type]
        return cls(client, url, creds)

    async def publish(self, subject: str, payload: bytes) -> None:
        await self.client.publish(subject, payload)

    async def subscribe(self, subject: str, handler: Handler) -> NatsSubscription:
        async def on_message(msg: Msg) -> None:
            await handler(msg.subject, msg.data)

        return NatsSubscription(await self.client.subscribe(subject, cb=on_message))

    async def flush(self, timeout_s: float = 5.0) -> None:
        await self.client.flush(timeout=max(1, round(timeout_s)))

    async def close(self) -> None:
        if not self.client.is_closed:
            await self.client.close()


class KvStore:
    """A JetStream KV bucket; revision-checked writes."""

    def __init__(self, kv: object) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, bus: NatsBus, bucket: str, *, replicas: int = 1) -> KvStore:
        js = bus.client.jetstream()
        try:
            kv = await js.key_value(bucket)
        except (NotFoundError, Exception):  # bucket missing: create it
            kv = await js.create_key_value(bucket=bucket, history=1, replicas=replicas)
        return cls(kv)

    async def get(self, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await self._kv.get(key)  # type: ignore[attr-defined]
        except KeyNotFoundError:
            return None
        return bytes(entry.value or b""), int(entry.revision)

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        try:
            if expected_revision is None:
                return int(await self._kv.create(key, value))  # type: ignore[attr-defined]
            return int(await self._kv.update(key, value, last=expected_revision))  # type: ignore[attr-defined]
        except KeyWrongLastSequenceError as exc:
            raise StoreConflict("conflict", detail=f"{key}: {exc}") from None

    async def keys(self) -> list[str]:
        try:
            return sorted(await self._kv.keys())  # type: ignore[attr-defined]
        except Exception as exc:  # nats-py raises NoKeysError on an empty bucket
            if type(exc).__name__ == "NoKeysError":
                return []
            raise
