"""Rules for a durable checkpoint directory that fails (full, read-only, vanished): no I/O.

The saver daemon records every failed attempt to persist (``store.jsonl`` in the shared-memory
directory, tailed by the agent, which forwards it to the master) and keeps a ``store-down``
file there while the directory fails; the training side reads that file so that a save does
not wait on a slot the daemon cannot persist. The decisions live here:

- :func:`failed` / :func:`succeeded`: the outage state, and whether this attempt opens an
  outage (reported at once, one incident) or ends one (one line when it comes back);
- :func:`backoff_s`: how long the daemon waits before the next attempt;
- :func:`save_may_proceed`: whether a save goes on past an unpersisted slot (dropping it:
  the newest save is the one kept) instead of waiting.
"""

from __future__ import annotations

import errno as errnos
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgspec

from aegis.wire import messages

STORE_LOG = "store.jsonl"  # one line per failed attempt, and one when persisting works again
STORE_DOWN = "store-down"  # present (JSON of the last failure) while the store fails

BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt to persist ``step`` into ``directory``."""

    step: int
    errno: int
    strerror: str
    directory: str

    @staticmethod
    def of(exc: OSError, step: int, directory: str) -> Failure:
        code = exc.errno or 0
        text = exc.strerror or str(exc) or errnos.errorcode.get(code, "error")
        return Failure(step, code, text, directory)

    def describe(self) -> str:
        return f"[Errno {self.errno}] {self.strerror}: {self.directory}"


@dataclass(frozen=True, slots=True)
class StoreState:
    """``failures``: failed attempts in a row (0: the store works); ``since``: when the current
    outage began (the caller's clock), None when there is none."""

    failures: int = 0
    since: float | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one attempt's outcome means: the new state, whether it opened an outage (report
    at once), whether it ended one (and after how long), and the wait before the next try."""

    state: StoreState
    opened: bool = False
    closed_after_s: float | None = None
    retry_in_s: float = 0.0


def failed(state: StoreState, now: float) -> Attempt:
    failures = state.failures + 1
    since = state.since if state.since is not None else now
    return Attempt(StoreState(failures, since), opened=state.failures == 0,
                   retry_in_s=backoff_s(failures))  # fmt: skip


def succeeded(state: StoreState, now: float) -> Attempt:
    if state.failures == 0 or state.since is None:
        return Attempt(StoreState())
    return Attempt(StoreState(), closed_after_s=max(0.0, now - state.since))


def backoff_s(failures: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S) -> float:
    """Doubling from ``base_s`` after the first failure, at most ``cap_s`` (0 with none)."""
    if failures <= 0:
        return 0.0
    return float(min(cap_s, base_s * 2 ** min(failures - 1, 30)))


def save_may_proceed(store_down: bool, waited_s: float, timeout_s: float) -> bool | None:
    """A save finds a slot not yet persisted: ``True``, go on (the store is down: the older
    unpersisted slot is dropped, the newest save is kept in memory); ``None``, keep waiting
    (the daemon is persisting it); ``False``, give up (waited past ``timeout_s``)."""
    if store_down:
        return True
    if waited_s > timeout_s:
        return False
    return None


# What the agent tells the master: ``failures`` failed attempts (the last one's errno), ``opened``
# when the first of them began an outage; or ``ok``, the store works again after ``down_s``
# seconds. The daemon's report is the wire message itself (the agent forwards it as it is).
StoreReport: TypeAlias = messages.CheckpointStoreData

STRERROR_CHARS = 200  # what of the error's text travels


def reports_of(records: list[dict[str, Any]]) -> list[StoreReport]:
    """The lines of ``store.jsonl`` read since the last time, as few reports as keep their
    order: consecutive failures in one (counted, the newest error named), a recovery alone.
    A line that is not a daemon's record is skipped."""
    reports: list[StoreReport] = []
    for record in records:
        try:
            report = _report(record)
        except (KeyError, TypeError, ValueError):
            continue
        last = reports[-1] if reports else None
        if last is not None and not last.ok and not report.ok:
            reports[-1] = msgspec.structs.replace(
                report, failures=last.failures + 1, opened=last.opened or report.opened
            )
        else:
            reports.append(report)
    return reports


def _report(record: dict[str, Any]) -> StoreReport:
    step, directory = int(record["step"]), str(record["dir"])
    if record["event"] == "resumed":
        return StoreReport(directory, step, ok=True, down_s=float(record["down_s"]),
                           failures=int(record["failures"]))  # fmt: skip
    if record["event"] != "failed":
        raise ValueError(record["event"])
    strerror = str(record["strerror"])[:STRERROR_CHARS]
    return StoreReport(directory, step, False, int(record["errno"]), strerror, 1,
                       bool(record["opened"]))  # fmt: skip
