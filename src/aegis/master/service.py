"""The master service: NATS (master credentials), the status store, the credentials gRPC
server, and one ``JobRunner`` per job."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from grpc import aio

from aegis.adapters import nats_text
from aegis.adapters.grpc import creds as grpc_creds
from aegis.adapters.nats_auth import Authority, UserCreds
from aegis.adapters.nats_bus import KvStore, NatsBus
from aegis.adapters.ports import Bus, StatusStore, StoreConflictError, Subscription
from aegis.adapters.tls import TlsDir
from aegis.core.model import JobSpec, NodeName, check_names, initial_status
from aegis.core.phases import TERMINAL_PHASES
from aegis.master import job_builder, job_record, ping, records
from aegis.master.job_runner import JobRunner, JobSettings
from aegis.master.job_settings import status_key
from aegis.master.ports import Platform
from aegis.spawn import owners

log = logging.getLogger(__name__)

STATUS_BUCKET = "aegis-jobs"
LAST_WRITE_S = 10.0  # how long a closing master lets an ended job's loop finish its writes


class CredsServerSettings(Protocol):
    """Where a master serves the credentials handshake (``MasterSettings``,
    ``ReplicaSettings``)."""

    @property
    def grpc_host(self) -> str: ...
    @property
    def grpc_port(self) -> int: ...
    @property
    def creds_ttl_s(self) -> float | None: ...


async def serve_credentials(
    authority: Authority | None,
    nats_url: str,
    lookup: grpc_creds.Lookup,
    settings: CredsServerSettings,
    tls_dir: TlsDir | None = None,
) -> tuple[aio.Server, int]:
    """The credentials gRPC server of a master (one, or a replica), and its port."""
    return await grpc_creds.serve(authority, nats_url, lookup, host=settings.grpc_host,
                                  port=settings.grpc_port, ttl_s=settings.creds_ttl_s,
                                  tls_dir=tls_dir)  # fmt: skip


@dataclass(slots=True)
class MasterSettings:
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    creds_ttl_s: float | None = 3600.0
    job: JobSettings = field(default_factory=JobSettings)
    # how long a new job asks whether a job of its name, created by a run on another host or
    # container, is still led (``ping.still_led``); no answer all that time frees the name
    creator_answer_s: float = 10.0


class MasterService:
    def __init__(
        self,
        authority: Authority | None,
        nats_url: str,
        bus: Bus,
        store: StatusStore,
        settings: MasterSettings,
    ) -> None:
        self.authority, self.nats_url = authority, nats_url
        self.bus, self.store, self.settings = bus, store, settings
        self.builder = job_builder.JobBuilder(
            bus, store, settings.job, job_builder.signer_of(authority)
        )
        self.jobs: dict[tuple[str, str], JobRunner] = {}
        self.tokens: dict[tuple[str, str], str] = {}
        self.grpc_port = 0
        self._server: object = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._claiming: set[tuple[str, str]] = set()  # names being created (``create_job``)
        self.answering: Subscription | None = None  # pings of its jobs (``ping.serve``)
        self._answer_once = asyncio.Lock()  # (two jobs created at once subscribe it once)

    @classmethod
    async def connect(
        cls, authority: Authority | None, nats_url: str, settings: MasterSettings
    ) -> MasterService:
        """``authority`` None: an existing NATS server without operator auth (``--nats URL``);
        agents then get no credentials and connect plainly."""
        creds = authority.master_creds() if authority is not None else None
        bus = await NatsBus.connect(nats_url, creds, name="aegis-master")
        store = await KvStore.open(bus, STATUS_BUCKET)
        service = cls(authority, nats_url, bus, store, settings)
        await service.start_grpc()
        return service

    async def start_grpc(self) -> None:
        server, port = await serve_credentials(
            self.authority, self.nats_url, self._lookup, self.settings
        )
        self._server, self.grpc_port = server, port
        log.info("credentials server on %s:%d", self.settings.grpc_host, port)

    def _lookup(self, namespace: str, job: str) -> grpc_creds.JobAccess | None:
        runner = self.jobs.get((namespace, job))
        if runner is None:
            return None
        pods = tuple(sorted(runner.status.pod_infos, key=lambda p: int(p.rsplit("-", 1)[-1])))
        ended = runner.status.phase in TERMINAL_PHASES or runner.done.is_set()
        token, creation = self.tokens[(namespace, job)], runner.notes.creation
        return grpc_creds.JobAccess(namespace, job, token, pods, ended, creation)

    async def create_job(
        self,
        spec: JobSpec,
        nodes: list[str],
        platform: Platform,
        *,
        log_dir: Path | None,
        token: str | None = None,
        pod_ips: list[str] | None = None,
    ) -> tuple[JobRunner, str]:
        """``pod_ips``: each pod's address where the platform knows it before the pod starts
        (the rendezvous follows rank 0's). Raises ``InvalidNameError`` for a job or namespace name
        outside the one rule (``core.model.check_names``)."""
        check_names(spec.namespace, spec.job)
        key = (spec.namespace, spec.job)
        async with self._answer_once:  # from its first job's first record on
            if self.answering is None:
                self.answering = await ping.serve(
                    self.bus, lambda ns, job: self.jobs.get((ns, job))
                )
        if key in self.jobs or key in self._claiming:
            raise records.JobExistsError(f"job {spec.namespace}/{spec.job} exists in this master")
        self._claiming.add(key)  # (while the store is asked, no other call here takes it)
        try:
            await self._claim_name(spec)
            token = token or secrets.token_urlsafe(24)
            status = initial_status(spec, [NodeName(n) for n in nodes], pod_ips=pod_ips)
            creator = job_record.JobNotes(creator=owners.process_name())  # (``_claim_name``)
            runner = self.builder.new(spec, status, platform, log_dir, creator)
            self.jobs[key], self.tokens[key] = runner, token
            try:
                await runner.start(nodes, pod_ips)
            except BaseException as exc:  # no job: forget it, and its log's file
                del self.jobs[key], self.tokens[key]
                runner.events.close()
                if isinstance(exc, StoreConflictError):  # the name was taken since the claim
                    raise self._exists(spec, "was taken meanwhile by another run") from None
                raise
        finally:
            self._claiming.discard(key)
        task = asyncio.create_task(runner.run(), name=f"job:{spec.job}")
        runner.task = task
        self._tasks.add(task)
        task.add_done_callback(self._job_task_done)
        return runner, token

    def _job(self, namespace: str, job: str) -> JobRunner | None:
        return self.jobs.get((namespace, job))

    async def _claim_name(self, spec: JobSpec) -> None:
        """Raises ``JobExistsError`` while the store holds a job of this name that is not over
        (``records.still_held``); removes one that has ended, or whose master is gone: a killed
        run of this host, or one of another host or container that does not answer for it
        (``ping.still_led``): the new job replaces it."""
        found = await self.store.get(key := status_key(spec))
        if found is None:
            return
        raw, revision = found
        if (why := records.still_held(raw, owners.process_gone)) is not None:
            if records.still_held(raw, owners.elsewhere) is not None:
                raise self._exists(spec, why)
            # held only by an ``aegis run`` this host cannot judge: is it still there?
            creation = records.decode_record(raw)[0].creation  # (read: still_held did)
            if (led := await self._still_led(spec, creation)) is not None:
                raise self._exists(spec, led)
        if not await self.store.remove(key, revision):
            raise self._exists(spec, "changed as this run looked at it (written by its leader, "
                               "or by another run taking the name)")  # fmt: skip
        log.info("job %s/%s: the record of the job of that name (ended, or left by a master "
                 "that is gone) is replaced", spec.namespace, spec.job)  # fmt: skip

    async def _still_led(self, spec: JobSpec, creation: str) -> str | None:
        creds = getattr(self.bus, "creds", None)
        prefix = creds.inbox_prefix if isinstance(creds, UserCreds) else "_INBOX"
        window = self.settings.creator_answer_s
        led = await ping.still_led(self.bus, spec.namespace, spec.job, inbox_prefix=prefix,
                                   window_s=window, creation=creation)  # fmt: skip
        if led is None:
            log.warning("job %s/%s: nobody answered for the run on another host or container "
                        "that created it in %.0f s: it is gone", spec.namespace, spec.job,
                        window)  # fmt: skip
        return led

    def _exists(self, spec: JobSpec, why: str) -> records.JobExistsError:
        where = nats_text.shown(self.nats_url)
        return records.JobExistsError(
            f"job {spec.namespace}/{spec.job} in the status store of {where} {why}; "
            "run it under another --job"
        )

    def _job_task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("job task %s crashed", task.get_name(), exc_info=task.exception())

    async def close(self) -> None:
        """Stop every job's loop; one whose job has ended first finishes its last write, for
        ``LAST_WRITE_S`` at most (the record then says its end was carried out: a record left
        ``end_pending`` keeps the job's name from the next run of it, ``records.still_held``)."""
        ending = [r.task for r in self.jobs.values() if r.done.is_set() and r.task is not None]
        if pending := [task for task in ending if not task.done()]:
            await asyncio.wait(pending, timeout=LAST_WRITE_S)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(grace=0.5)  # type: ignore[attr-defined]
        if self.answering is not None:
            with contextlib.suppress(Exception):  # (a closed connection is no error)
                await self.answering.unsubscribe()
        await self.bus.close()
