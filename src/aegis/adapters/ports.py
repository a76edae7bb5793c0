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

    @property
    def connected(self) -> bool:
        """False while the connection is lost (reconnecting, or closed): nothing is heard."""
        ...


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


class LeaseTakenError(RemoteError):
    """The lease key is held by someone, or moved on since the revision we expected."""


class LeaseStore(Protocol):
    """One lease key with a time to live (the master's leader election lives here).

    Revisions grow with every write, and with the key's expiry or removal: a vacant key has the
    revision of its removal (or 0 when it was never written), and only a write that names the
    key's current revision succeeds."""

    async def open(self) -> None:
        """Create the lease's bucket if there is none."""
        ...

    async def vacant_revision(self) -> int:
        """The revision to overwrite when nobody holds the lease; raises ``LeaseTakenError``
        when a live lease is there."""
        ...

    async def holder(self) -> tuple[str, int] | None:
        """Who holds the live lease, and the revision it wrote; None when the key is vacant. A
        holder whose write took effect but whose answer was lost finds its own name here."""
        ...

    async def write(self, holder: str, *, expected: int, ttl_s: float, timeout_s: float) -> int:
        """Write the lease for ``holder``, expiring ``ttl_s`` later, if the key is still at
        revision ``expected``; returns the new revision. Raises ``LeaseTakenError`` when the key
        moved on; any other exception is a failure of the store itself (try again)."""
        ...

    async def wait_vacancy(self, timeout_s: float) -> None:
        """Until the lease is removed or expires, or ``timeout_s`` passed. May watch the key
        until ``stop_watching``; one watch serves every wait."""
        ...

    async def stop_watching(self) -> None: ...

    async def remove(self, expected: int) -> None:
        """Remove the lease now (its holder's clean shutdown) if the key is still at revision
        ``expected`` (the holder's last write); raises ``LeaseTakenError`` when it moved on (a
        deposed holder never removes its successor's lease)."""
        ...
