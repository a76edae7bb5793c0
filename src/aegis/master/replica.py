"""A master replica (``aegis master``): standby until it holds the lease, then leader of every job.

Jobs live in the status bucket (one record per job, written by whoever submits the job, then
only by the leader). The leader loads every non-terminal job (``JobRunner.takeover``) and keeps
polling the bucket for new ones (``KvStore.keys``: a listing that leaves no consumer behind;
a record that is not a job's is skipped and counted in ``malformed``); when the lease is lost
it stops every runner at once (their ``fence`` already refuses to write or publish) and goes
back to standby. Nodes drained by
``aegis ctl drain`` are recorded in their own bucket (``drained_nodes``): every job adopted
later is told of them, by this leader or the next. Every replica serves
the credentials handshake, so an agent may bootstrap from any of them.

On a JetStream cluster the status bucket has as many copies as the lease bucket
(``LeaseSettings.replicas``). A store read that fails while a bucket elects a new leader is tried
again on the next poll; a job loop that died of a store error (not of a lost lease) is dropped
and adopted again from its stored record, as a new leader would (agents re-send the reports it
had not answered yet; each is counted once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from aegis.adapters.aio import cancellations, raise_if_cancelled
from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.tls import TlsDir
from aegis.core import retention
from aegis.core.model import (
    JobSpec,
    JobStatus,
)
from aegis.core.phases import TERMINAL_PHASES
from aegis.master import (
    control,
    drained_nodes,
    faultlog,
    job_builder,
    job_log,
    job_record,
    metrics,
    node_drains,
    platform_events,
    records,
    service,
)
from aegis.master.job_runner import JobRunner
from aegis.master.job_settings import AfterPersist, JobSettings, LeadershipLostError
from aegis.master.lease import LeaseSettings, nats_lease
from aegis.master.remote_platform import RemotePlatform
from aegis.master.service import STATUS_BUCKET

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    replica_id: str
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    job: JobSettings = field(default_factory=JobSettings)
    log_dir: Path | None = None
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    poll_s: float = 0.25
    creds_ttl_s: float | None = 3600.0
    tls_dir: TlsDir | None = None  # the credentials server's certificate; NATS's CA (ca.crt)
    keep_ended_s: float = retention.KEEP_ENDED_S  # an ended job's record, then removed (0: kept)
    clock: Callable[[], float] = time.monotonic  # when a job was seen ended, and is now

    @property
    def nats_ca(self) -> Path | None:
        return self.tls_dir.ca if self.tls_dir is not None else None


RECHECKS_PER_PASS = 4  # held records a refresh reads again (each in turn)
LOOKUP_READ_S = 2.0  # how long a handshake waits for the store before using the cached record


class Replica:
    def __init__(
        self,
        authority: Authority | None,
        nats_url: str,
        settings: ReplicaSettings,
        after_persist: AfterPersist | None = None,
    ) -> None:
        """``after_persist``: a failover test's hook (``master.chaos``), given to every job."""
        self.authority, self.nats_url, self.settings = authority, nats_url, settings
        self.after_persist = after_persist
        self.runners: dict[str, JobRunner] = {}
        self.adopted: list[Callable[[str], None]] = []  # told each key this leader adopts
        self.records: dict[str, job_record.JobRecord] = {}
        self.finished: dict[str, retention.Ended] = {}  # ended jobs: their keys, no records
        self.removed = 0  # ended jobs' records removed by this replica (leading)
        self.metrics: metrics.MasterMetrics | None = None  # set to serve /metrics
        self.grpc_port = 0
        self.leading = asyncio.Event()
        self._fault_lines: faultlog.RotatingJsonLines | None = None  # log_dir/faults.jsonl
        self.malformed = records.MalformedRecords(settings.replica_id)  # skipped records, counted

    async def run(self) -> None:
        creds = self.authority.master_creds() if self.authority else None
        self.bus = await NatsBus.connect(
            self.nats_url, creds, name=self.settings.replica_id, tls_ca=self.settings.nats_ca
        )
        self.store = await KvStore.open(
            self.bus, STATUS_BUCKET, replicas=self.settings.lease.replicas
        )
        drained = await KvStore.open(
            self.bus, drained_nodes.BUCKET, replicas=self.settings.lease.replicas
        )
        self.drained = drained_nodes.DrainedNodes(drained)
        self.platform_events = platform_events.PlatformEvents(self.bus)
        self.builder = job_builder.JobBuilder(
            self.bus, self.store, self.settings.job, job_builder.signer_of(self.authority),
            after_persist=self.after_persist,
        )  # fmt: skip
        self.lease = nats_lease(self.bus.client, self.settings.replica_id, self.settings.lease)
        await self.lease.open()
        server, self.grpc_port = await service.serve_credentials(
            self.authority, self.nats_url, self._lookup, self.settings, self.settings.tls_dir
        )
        refresher = asyncio.create_task(self._refresh_records(), name="records")
        try:
            while True:
                epoch = await self.lease.wait_for_lead()
                await self._lead(epoch)
        finally:
            refresher.cancel()
            try:  # each step even when one before failed: the bus closes last, always
                await _logged(self._stop_runners(), "stopping the jobs")
                await self.lease.release()
                await _logged(server.stop(grace=0.5), "stopping the gRPC server")
            finally:
                await self.bus.close()

    async def _lead(self, epoch: int) -> None:
        ctl = await control.serve_leader(
            self.bus, lambda: self.runners, self.drained, self.settings.log_dir
        )
        self.leading.set()  # it serves aegis ctl (its control file written) from now on
        try:
            async with asyncio.TaskGroup() as group:
                keeper = group.create_task(self.lease.keep(), name="lease")
                poller = group.create_task(self._poll_jobs(epoch), name="jobs")
                await keeper
                poller.cancel()
        except* LeadershipLostError:
            log.warning("replica %s: deposed (epoch %d)", self.settings.replica_id, epoch)
        finally:
            self.leading.clear()
            await ctl.unsubscribe()
            await self._stop_runners()
            await self.lease.release()  # ours still: freed at once; else its epoch forgotten
            # (a stale epoch kept for a later release once removed a successor's lease)

    def _fence(self) -> None:
        if not self.lease.held:
            raise LeadershipLostError(f"replica {self.settings.replica_id} lost the lease")

    async def _poll_jobs(self, epoch: int) -> None:
        since = cancellations()
        while True:
            await self._drop_failed_runners()
            try:
                listed = await self.store.keys()
                for key in listed:
                    if key not in self.runners and key not in self.finished:
                        await self._adopt(key, epoch)
                await self._remove_expired(listed)
            except LeadershipLostError:
                raise
            except Exception as exc:  # a bucket electing a leader: try again on the next poll
                raise_if_cancelled(since)
                log.warning("replica %s: polling jobs failed: %r", self.settings.replica_id, exc)
            raise_if_cancelled(since)
            await asyncio.sleep(self.settings.poll_s)

    def _ended(self, key: str, revision: int) -> None:
        """The job has ended: keep its key (and when it was seen ended), not its record."""
        self.finished.setdefault(key, retention.Ended(self.settings.clock(), revision))
        self.records.pop(key, None)

    async def _remove_expired(self, listed: list[str]) -> None:
        """The leader removes the records of jobs ended ``keep_ended_s`` ago (at the revision
        seen ended: a job submitted again under the name stays and is adopted next poll)."""
        self.finished = retention.still_listed(self.finished, listed)
        now = self.settings.clock()
        for key in retention.expired(self.finished, now, self.settings.keep_ended_s):
            seen = self.finished.get(key)  # the refresh may have forgotten it meanwhile
            if seen is None:
                continue
            self._fence()
            if await self.store.remove(key, seen.revision):
                self.removed += 1
            self.finished.pop(key, None)

    async def _drop_failed_runners(self) -> None:
        """A job loop that died of an error (a store timeout through a failover), not of a
        lost lease: forget it, so the next poll adopts the job again from its record. A loop
        that returned (the job ended): forget it too, and its subscriptions, so a master that
        serves jobs for days holds only the running ones (the key stays in ``finished``)."""
        for key, runner in list(self.runners.items()):
            outcome = records.loop_outcome(task := runner.task)
            if outcome == "ended":
                self._ended(key, runner.revision or 0)
            elif outcome == "died" and task is not None:
                log.error("replica %s: job %s loop died (%r): adopting it again",
                          self.settings.replica_id, key, task.exception())  # fmt: skip
            if outcome in ("ended", "died"):
                del self.runners[key]
                await self._unsubscribe(runner, key)

    async def _read_job(
        self, key: str
    ) -> tuple[job_record.JobRecord, int, JobSpec, JobStatus] | None:
        """The job's stored record and revision, read; None when there is none, or when it is
        not a job's (skipped and counted: ``malformed``)."""
        got = await self.store.get(key)
        if got is None or self.malformed.revisions.get(key) == got[1]:
            return None  # none, or this very revision was found malformed (and counted)
        try:
            record, spec, status = records.decode_record(got[0])
        except records.MalformedRecordError as exc:
            self.malformed.found(key, got[1], exc)
            return None
        self.malformed.forget(key)
        return record, got[1], spec, status

    async def _adopt(self, key: str, epoch: int) -> None:
        read = await self._read_job(key)
        if read is None:
            return
        record, revision, spec, status = read
        if status.phase in TERMINAL_PHASES:
            if record.end_pending:  # the old leader may have died before telling anyone
                revision = await self._finish_end(key, record, revision, epoch)
            self._ended(key, revision)  # a key, not the record: memory does not grow with them
            return
        self.records[key] = record
        holder: list[JobRunner] = []
        platform = RemotePlatform(self.bus, spec, lambda: holder[0].status.seq, epoch)
        log_dir = job_log.event_log_dir(self.settings.log_dir, spec, status, record)
        runner = self.builder.adopt(record, revision, platform, log_dir, epoch=epoch,
                                    fence=self._fence)  # fmt: skip
        holder.append(runner)
        self.runners[key] = runner  # from now on a drain reaches it; and one made before:
        try:  # a failure (a store electing its leader) leaves no runner without a loop behind
            drained = await self.drained.load()
            for node, reason in drained.items():
                platform.blacklist[node] = f"drained: {reason}"
                await platform.drain_node(node, reason)
            self._observe(runner)
            await self.platform_events.follow(runner)
            await platform.resend_events()  # a NodeDown published while no replica listened
            await runner.takeover()
        except BaseException:
            del self.runners[key]
            await self._unsubscribe(runner, key)
            raise
        pods = node_drains.pods_on(runner.status, drained)
        if pods:  # placed on a drained node before this leader knew the job
            why = "; ".join(f"{node}: {reason}" for node, reason in sorted(drained.items()))
            runner.drain(pods, f"on a drained node ({why})", self.settings.job.drain_deadline_s)
        runner.task = asyncio.create_task(runner.run(), name=f"job:{key}")
        log.info("replica %s leads job %s (epoch %d)", self.settings.replica_id, key, epoch)
        for adopted in self.adopted:
            adopted(key)

    async def _finish_end(
        self, key: str, record: job_record.JobRecord, revision: int, epoch: int
    ) -> int:
        """The end of a job that ended under the old leader, carried out again (its pods told
        to exit, its platform to end it); the record's revision after."""
        spec, status = record.job()
        platform = RemotePlatform(self.bus, spec, lambda: status.seq, epoch)
        runner = self.builder.adopt(record, revision, platform, None, epoch=epoch,
                                    fence=self._fence)  # fmt: skip
        await runner.finish_end()
        log.info("replica %s: job %s ended under the last leader: its end carried out",
                 self.settings.replica_id, key)  # fmt: skip
        return runner.revision or revision

    def _observe(self, runner: JobRunner) -> None:
        """The observers of every job it leads (with the environment report): fault log,
        metrics."""
        if self.settings.log_dir is not None:  # one faults.jsonl for every job it leads
            path = self.settings.log_dir / "faults.jsonl"
            if self._fault_lines is None:
                self._fault_lines = faultlog.RotatingJsonLines(path)
            faultlog.FaultLog(path, out=self._fault_lines).attach(runner)
        if self.metrics is not None:
            self.metrics.attach(runner, gpu_type=metrics.host_gpu_type())

    async def _unsubscribe(self, runner: JobRunner, key: str) -> None:
        """Detach a stopped runner from NATS (its own loop unsubscribes only when it ends)."""
        if self.metrics is not None and not runner.done.is_set():
            self.metrics.detach(runner)  # a loop that died (or never ran): another reports
        await runner.unsubscribe()
        await self.platform_events.stop_following(key)

    async def _stop_runners(self) -> None:
        runners, self.runners = dict(self.runners), {}
        for runner in runners.values():
            if runner.task is not None:
                runner.task.cancel()
        for key, runner in runners.items():
            if runner.task is not None:
                with contextlib.suppress(BaseException):
                    await runner.task
            await self._unsubscribe(runner, key)

    async def _refresh_records(self) -> None:
        """Every replica knows every job's pods and token (for the credentials handshake)."""
        since = cancellations()
        while True:
            try:
                listed = await self.store.keys()
                for key in listed:
                    known = key in self.records or key in self.finished
                    if not known and (read := await self._read_job(key)):
                        if read[3].phase in TERMINAL_PHASES:
                            if not read[0].end_pending:  # else the next leader finishes it
                                self._ended(key, read[1])  # ended: its key is all that is kept
                        else:
                            self.records[key] = read[0]
                self._forget_removed(listed)
                await self._recheck_records()
            except Exception as exc:  # a bucket electing a leader: try again on the next poll
                raise_if_cancelled(since)
                log.debug(
                    "replica %s: refreshing records failed: %r", self.settings.replica_id, exc
                )
            raise_if_cancelled(since)
            await asyncio.sleep(self.settings.poll_s)

    async def _recheck_records(self, per_pass: int = RECHECKS_PER_PASS) -> None:
        """A few of the held records (of jobs this replica does not lead) read again, in turn:
        one that has ended since is dropped to its key, so a standby that waited for days keeps
        the records of the live jobs only."""
        others = [key for key in self.records if key not in self.runners]
        for key in others[:per_pass]:
            read = await self._read_job(key)
            if read is not None and read[3].phase in TERMINAL_PHASES and read[0].end_pending:
                del self.records[key]  # ended, its end maybe not carried out: not filed
            elif read is None or read[3].phase in TERMINAL_PHASES:
                self._ended(key, read[1] if read is not None else 0)
            else:
                del self.records[key]  # re-inserted last: the next pass reads the others first
                self.records[key] = read[0]

    def _forget_removed(self, listed: list[str]) -> None:
        """Records and keys the bucket no longer lists (removed after their retention): a
        standby keeps no more than the leader."""
        self.finished = retention.still_listed(self.finished, listed)
        present = set(listed)
        for key in [key for key in self.records if key not in present and key not in self.runners]:
            del self.records[key]

    async def _lookup(self, namespace: str, job: str) -> grpc_creds.JobAccess | None:
        """The job as it is now: the leader's own runner, else its record read afresh (the one
        known from the last refresh when the store does not answer), so an ended job gets no
        more credentials."""
        key = f"{namespace}.{job}"
        runner = self.runners.get(key)
        record = self.records.get(key)
        if runner is None:
            try:
                read = await asyncio.wait_for(self._read_job(key), LOOKUP_READ_S)
            except Exception as exc:  # a bucket electing a leader: what the last refresh saw
                if record is None:
                    raise  # not a refusal: the agent asks again (or another replica)
                log.debug("replica %s: reading %s failed: %r", self.settings.replica_id, key, exc)
            else:
                if read is None:
                    return None
                record = read[0]
                if read[3].phase not in TERMINAL_PHASES:
                    self.records[key] = record
        live = None
        if runner is not None:
            notes, status = runner.notes, runner.status
            live = records.Live(list(status.pod_infos), status.phase, notes.token, notes.creation)
        return records.job_access(namespace, job, live, record, key in self.finished)


async def _logged(step: Awaitable[object], what: str) -> None:
    """A step of the replica's shutdown: an error is logged, and the next step runs."""
    try:
        await step
    except Exception as exc:  # NATS gone, say: the shutdown goes on
        log.warning("%s failed at shutdown: %r", what, exc)
