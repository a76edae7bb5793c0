"""The status bucket's records as a replica reads them: a job's, or one to skip and count (not
JSON, not a job's fields, a name outside the rule): one bad record never breaks a poll."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from aegis.adapters.grpc.creds import JobAccess
from aegis.adapters.ports import StatusStore
from aegis.core.errors import AegisError, SetupError
from aegis.core.model import JobSpec, JobStatus, NodeName, check_names, initial_status
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.master import job_record
from aegis.master.job_settings import LeadershipLostError, status_key

log = logging.getLogger(__name__)


class MalformedRecordError(AegisError, ValueError):
    """A status-bucket record that is not a job's (not JSON, or not a job's fields)."""


async def submit_job(
    store: StatusStore,
    spec: JobSpec,
    nodes: list[str],
    token: str,
    pod_ips: list[str] | None = None,
) -> int:
    """Write a new job's first record; the leader picks it up (not one whose name is outside
    the rule, ``core.model.check_names``: that record is skipped and counted as malformed).
    It has no creation id: its subjects are ``aegis.<ns>.<job>``, as an older replica of a
    rolling upgrade has them (it would drop the id at its first write, and hand out
    credentials without it); its name is taken again only once it ended (``still_held``)."""
    status = initial_status(spec, [NodeName(n) for n in nodes], pod_ips=pod_ips)
    record = job_record.build(spec, status, job_record.JobNotes(token=token, nodes=list(nodes)))
    return await store.put(status_key(spec), job_record.encode(record), expected_revision=None)


class JobExistsError(SetupError):
    """A job of that name is in the status store and not over: a new one is refused."""


def still_held(raw: bytes, creator_gone: Callable[[str], bool]) -> str | None:
    """Why a stored record keeps its name from a new job: the job is not over, or its end is
    still being carried out (``end_pending``), or the record is none this version can read
    (perhaps a newer version's job). None when a new job may replace it: the job has ended,
    or the master that created and still leads it (``JobNotes.creator``, epoch 0: a killed
    ``aegis run``) is known to be gone (``creator_gone``). A job submitted to replicas names
    no creator, and one a replica adopted has a new epoch: their leader is judged by its
    lease, not here."""
    try:
        record, _, status = decode_record(raw)
    except MalformedRecordError as exc:
        return f"holds a record this version cannot read ({exc})"
    ended = status.phase in TERMINAL_PHASES
    if ended and not record.end_pending:
        return None
    if record.creator and record.epoch == 0 and creator_gone(record.creator):
        return None
    if ended:
        return f"is ending ({status.phase.value}, its end still being carried out)"
    return (f"is not over (phase {status.phase.value}): another run leads it, or one on "
            "another host or container was killed before its end")  # fmt: skip


def decode_record(raw: bytes) -> tuple[job_record.JobRecord, JobSpec, JobStatus]:
    """A stored job record, read (``job_record``: records of earlier versions too); raises
    ``MalformedRecordError`` for one that is not a job's (not JSON, not a job's fields, orders
    of another shape, a job or namespace name outside the rule: such a job is never adopted).
    Notes a new leader can go without that have another shape are dropped, and logged: the job
    is adopted without them (``job_record.read``)."""
    try:
        record, dropped = job_record.read(raw)
        spec, status = record.job()
        check_names(spec.namespace, spec.job)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise MalformedRecordError(f"{type(exc).__name__}: {exc}") from None
    if dropped:
        log.warning("job %s.%s: its record's %s had another shape, dropped: the leader starts "
                    "them afresh", spec.namespace, spec.job, ", ".join(dropped))  # fmt: skip
    return record, spec, status


class MalformedRecords:
    """The status bucket's records that are not a job's: every poll skips them (the other jobs
    are adopted as ever). Each is counted once per stored revision (``count``; ``revisions``:
    key -> the revision found malformed) and logged at most once per ``log_every_s``, that
    line saying how many came since the last one. A key that holds a job again is forgotten."""

    def __init__(self, replica_id: str, log_every_s: float = 60.0) -> None:
        self.count = 0
        self.revisions: dict[str, int] = {}
        self.replica_id, self.log_every_s = replica_id, log_every_s
        self._logged_at: float | None = None
        self._unlogged = 0

    def found(self, key: str, revision: int, error: Exception) -> None:
        if self.revisions.get(key) == revision:
            return  # this very record was counted (and logged, or summed into the next line)
        self.revisions[key] = revision
        self.count += 1
        self._unlogged += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.log_every_s:
            return
        log.warning("replica %s: skipping %d malformed record(s) of the status bucket "
                    "(%d in all), the latest %r: %.200r", self.replica_id, self._unlogged,
                    self.count, key[:100], str(error))  # fmt: skip
        self._logged_at, self._unlogged = now, 0

    def forget(self, key: str) -> None:
        self.revisions.pop(key, None)


@dataclass(frozen=True, slots=True)
class Live:
    """A job this replica leads, as its runner has it now."""

    pods: list[str]
    phase: Phase
    token: str  # "" when the runner has none
    creation: str = ""  # the id of the job's creation (its subjects)


def job_access(
    namespace: str, job: str, live: Live | None, record: job_record.JobRecord | None, ended: bool
) -> JobAccess | None:
    """What the credentials handshake may hand out for the job: from its runner when this
    replica leads it (the token from its record if the runner has none), else from its record;
    None when neither is known. ``ended``: its key is among the ended jobs'."""
    if live is not None:
        pods, phase = live.pods, live.phase.value
        token = live.token or (record.token if record else "")
        creation = live.creation
    elif record is not None:
        pods, phase = list(record.status["pod_infos"]), str(record.status["phase"])
        token, creation = record.token, record.creation
    else:
        return None
    ended = ended or phase in {p.value for p in TERMINAL_PHASES}
    by_rank = tuple(sorted(pods, key=lambda p: int(p.rsplit("-", 1)[-1])))
    return JobAccess(namespace, job, token, by_rank, ended, creation)


LoopOutcome = Literal["running", "ended", "deposed", "died"]


def loop_outcome(task: asyncio.Task[None] | None) -> LoopOutcome:
    """How a led job's loop stands: still running (or cancelled: the leader stops it), ended
    with the job, stopped by a lost lease (the replica goes back to standby), or died of an
    error (a store timeout through a failover: the job is adopted again from its record)."""
    if task is None or not task.done() or task.cancelled():
        return "running"
    error = task.exception()
    if error is None:
        return "ended"
    if isinstance(error, LeadershipLostError):
        return "deposed"
    if isinstance(error, BaseExceptionGroup) and error.subgroup(LeadershipLostError):
        return "deposed"
    return "died"
