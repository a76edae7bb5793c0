"""Ports: what the master and the agent need from the outside world, as ``typing.Protocol``.

Each port has a real adapter and an in-memory fake, and one contract test suite runs against
both (``tests/test_contract_*.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from aegis.core.errors import RemoteError

Handler = Callable[[str, bytes], Coroutine[Any, Any, None]]  # (subject, payload)


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class Bus(Protocol):
    """Publish/subscribe on subjects (NATS semantics: ``*`` one token, ``>`` the rest)."""

    async def publish(self, subject: str, payload: bytes) -> None: ...

    async def subscribe(self, subject: str, handler: Handler) -> Subscription: ...

    async def flush(self, timeout_s: float = 5.0) -> None: ...

    async def close(self) -> None: ...


class StoreConflictError(RemoteError):
    """A revision-checked write lost: someone else wrote the key since we read it."""


class StatusStore(Protocol):
    """Key-value store with optimistic concurrency (the job status lives here)."""

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """The value and its revision, or None."""
        ...

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        """Write ``value`` if the key is still at ``expected_revision`` (None: must not exist).
        Returns the new revision; raises ``StoreConflictError`` otherwise."""
        ...

    async def keys(self) -> list[str]:
        """Every key that holds a record, sorted, whatever the records hold (a value that is
        not a job is the reader's to skip). Called on every poll, for as long as a master runs:
        a call leaves nothing behind on the server (no consumer, no subscription)."""
        ...

    async def remove(self, key: str, revision: int) -> bool:
        """Remove the key's record if it is still at ``revision`` (or older), leaving no trace
        (``keys`` no longer lists it; a later create of the key succeeds). False when a newer
        revision is there: that one stays."""
        ...
