"""In-memory fakes of the ports, for tests and for the contract suite's second implementation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from aegis.adapters.ports import Handler, LeaseTakenError, StoreConflictError


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` matches one token, a final ``>`` one or more."""
    parts, tokens = pattern.split("."), subject.split(".")
    for index, part in enumerate(parts):
        if part == ">":
            return len(tokens) > index
        if index >= len(tokens) or (part != "*" and part != tokens[index]):
            return False
    return len(tokens) == len(parts)


class _MemorySubscription:
    def __init__(self, bus: MemoryBus, key: int) -> None:
        self._bus, self._key = bus, key

    async def unsubscribe(self) -> None:
        self._bus.handlers.pop(self._key, None)


class MemoryBus:
    def __init__(self) -> None:
        self.connected = True  # a test sets it False for a lost connection (delivery goes on)
        self.handlers: dict[int, tuple[str, Handler]] = {}
        self._next = 0
        self._pending: set[asyncio.Task[None]] = set()

    async def publish(self, subject: str, payload: bytes) -> None:
        for pattern, handler in list(self.handlers.values()):
            if subject_matches(pattern, subject):
                task = asyncio.create_task(handler(subject, payload))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    async def subscribe(self, subject: str, handler: Handler) -> _MemorySubscription:
        self._next += 1
        self.handlers[self._next] = (subject, handler)
        return _MemorySubscription(self, self._next)

    async def flush(self, timeout_s: float = 5.0) -> None:
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

    async def close(self) -> None:
        self.handlers.clear()
        self.connected = False


class MemoryStore:
    def __init__(self) -> None:
        self.data: dict[str, tuple[bytes, int]] = {}
        self._revision = 0

    async def get(self, key: str) -> tuple[bytes, int] | None:
        return self.data.get(key)

    async def put(self, key: str, value: bytes, *, expected_revision: int | None) -> int:
        current = self.data.get(key)
        current_revision = current[1] if current else None
        if current_revision != expected_revision:
            raise StoreConflictError("conflict", detail=f"{key} at {current_revision}")
        self._revision += 1
        self.data[key] = (value, self._revision)
        return self._revision

    async def keys(self) -> list[str]:
        return sorted(self.data)

    async def remove(self, key: str, revision: int) -> bool:
        current = self.data.get(key)
        if current is not None and current[1] > revision:
            return False
        self.data.pop(key, None)
        return True


class MemoryLeaseStore:
    """The lease port in memory, on an injected clock: the lease expires when the clock passes
    its TTL (an expiry or a removal takes a revision, as the server's marker does). Share one
    between the ``Lease``s that compete for it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.revision = 0
        self.held_by: str | None = None
        self._expires_at = 0.0
        self._changed = asyncio.Condition()

    async def open(self) -> None:
        return None

    def _expire(self) -> None:
        if self.held_by is not None and self.clock() >= self._expires_at:
            self.held_by, self.revision = None, self.revision + 1

    async def vacant_revision(self) -> int:
        self._expire()
        if self.held_by is not None:
            raise LeaseTakenError("lease held", detail=self.held_by)
        return self.revision

    async def holder(self) -> tuple[str, int] | None:
        self._expire()
        return None if self.held_by is None else (self.held_by, self.revision)

    async def write(self, holder: str, *, expected: int, ttl_s: float, timeout_s: float) -> int:
        self._expire()
        if expected != self.revision:
            raise LeaseTakenError("lease moved on", detail=f"at {self.revision}, not {expected}")
        self.held_by, self.revision = holder, self.revision + 1
        self._expires_at = self.clock() + ttl_s
        return self.revision

    async def wait_vacancy(self, timeout_s: float) -> None:
        self._expire()
        if self.held_by is None:
            return
        left = min(timeout_s, max(0.0, self._expires_at - self.clock()))
        async with self._changed:
            with contextlib.suppress(TimeoutError):  # not wait_for: see adapters.aio
                async with asyncio.timeout(left):
                    await self._changed.wait()

    async def stop_watching(self) -> None:
        return None

    async def remove(self, expected: int) -> None:
        self._expire()
        if expected != self.revision:
            raise LeaseTakenError("lease moved on", detail=f"at {self.revision}, not {expected}")
        self.held_by, self.revision = None, self.revision + 1
        async with self._changed:
            self._changed.notify_all()
