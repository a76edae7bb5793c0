"""Read one job's record from a running master's store (the JetStream KV status bucket).

The connection is the master's own: ``--nats URL`` with ``--auth-file`` (the operator/account
keys every ``aegis master`` replica loads) or none on a server without auth, or the control file
of an ``aegis run`` (``--ctl-file``, as ``aegis ctl`` uses). The bucket is only read: a missing
bucket is "no such job", never created here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nats import errors as nats_errors

from aegis.adapters import nats_bus
from aegis.adapters.nats_auth import UserCreds
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.core.errors import AegisError
from aegis.master.service import STATUS_BUCKET

T = TypeVar("T")


class StoreReadError(AegisError):
    """The store could not be read (unreachable server, refused credentials, bad record)."""


@dataclass(frozen=True, slots=True)
class StoreTarget:
    nats_url: str
    creds: UserCreds | None
    namespace: str
    tls_ca: Path | None = None  # trust this CA only (a NATS server that speaks TLS)


async def read_record(target: StoreTarget, job: str, timeout_s: float) -> dict[str, Any] | None:
    """The job's record, or None when the store holds no such job. A refused connection (bad
    credentials) fails at once, with the server's reason (reported once, by the caller)."""
    with nats_bus.errors_unlogged():
        return await _read_record(target, job, timeout_s)


async def _read_record(target: StoreTarget, job: str, timeout_s: float) -> dict[str, Any] | None:
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    def on_error(exc: Exception) -> None:
        if not refused.done():
            refused.set_result(exc)

    try:
        async with asyncio.timeout(timeout_s):
            bus = await _first(
                NatsBus.connect(target.nats_url, target.creds, name="aegis-status",
                                max_reconnect_attempts=0, connect_timeout_s=timeout_s,
                                on_error=on_error, tls_ca=target.tls_ca),
                refused,
            )  # fmt: skip
            try:
                return await _first(_get(bus, f"{target.namespace}.{job}"), refused)
            finally:
                await bus.close()
    except TimeoutError:
        raise StoreReadError(f"no answer from {target.nats_url} within {timeout_s} s") from None
    except (OSError, nats_errors.Error, _RefusedError) as exc:
        reason = nats_bus.error_text(exc)
        if target.creds is None and "authorization" in reason.lower():
            reason += " (the server wants credentials: give --auth-file)"
        raise StoreReadError(f"cannot read the store at {target.nats_url}: {reason}") from None


class _RefusedError(AegisError):
    pass


async def _first(work: Coroutine[Any, Any, T], refused: asyncio.Future[Exception]) -> T:
    """``work``'s result, unless the connection reports an error first."""
    task = asyncio.ensure_future(work)
    waiting: set[asyncio.Future[Any]] = {task, refused}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise _RefusedError(nats_bus.error_text(refused.result()))


async def _get(bus: NatsBus, key: str) -> dict[str, Any] | None:
    store = await KvStore.existing(bus, STATUS_BUCKET)
    if store is None:
        return None  # no master has stored any job on this server
    got = await store.get(key)
    if got is None:
        return None
    try:
        record = json.loads(got[0])
    except ValueError as exc:
        raise StoreReadError(f"the record of {key} is not JSON: {exc}") from None
    if not isinstance(record, dict):
        raise StoreReadError(f"the record of {key} is not an object")
    return record
