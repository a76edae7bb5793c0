"""The one way a master builds a job's runner: for a job it starts (``MasterService``: ``aegis
run``, ``aegis slurm``) and for one it adopts from its stored record (``Replica``, a takeover).
Every runner gets the environment report (bootcheck's "multiple versions") as its observer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from aegis.adapters.nats_auth import Authority, new_creation
from aegis.adapters.ports import Bus, StatusStore
from aegis.core.model import JobSpec, JobStatus
from aegis.master import env_report, job_record
from aegis.master.job_runner import JobRunner
from aegis.master.job_settings import AfterPersist, Clocks, JobSettings, no_fence
from aegis.master.ports import Platform
from aegis.master.round_orders import RoundOrder

Signer = Callable[[bytes], str]


def signer_of(authority: Authority | None) -> Signer | None:
    """Orders signed with the authority's key; unsigned on a server without auth."""
    return authority.sign_order if authority is not None else None


@dataclass(frozen=True, slots=True)
class JobBuilder:
    """What every job of one master shares."""

    bus: Bus
    store: StatusStore
    settings: JobSettings
    signer: Signer | None = None
    clocks: Clocks = field(default_factory=Clocks)
    after_persist: AfterPersist | None = None  # a failover test's hook (``job_settings``)

    def new(
        self,
        spec: JobSpec,
        status: JobStatus,
        platform: Platform,
        log_dir: Path | None,
        notes: job_record.JobNotes | None = None,
    ) -> JobRunner:
        """A job this master starts (``JobRunner.start`` writes its first record), under a new
        creation id (its subjects: ``nats_auth.job_subject_prefix``)."""
        notes = msgspec.structs.replace(notes or job_record.JobNotes(), creation=new_creation())
        return self._runner(spec, status, platform, log_dir, _Stored(notes=notes))

    def adopt(
        self,
        record: job_record.JobRecord,
        revision: int,
        platform: Platform,
        log_dir: Path | None,
        *,
        epoch: int,
        fence: Callable[[], None],
    ) -> JobRunner:
        """A job read back from the store by the leader of ``epoch`` (``JobRunner.takeover``
        continues it); ``KeyError``/``ValueError``/``TypeError`` for a record of another shape."""
        spec, status = record.job()
        notes = msgspec.structs.replace(record.notes, creator="")  # led by this replica now
        stored = _Stored(revision, epoch, fence, notes, tuple(record.orders))
        return self._runner(spec, status, platform, log_dir, stored)

    def _runner(
        self,
        spec: JobSpec,
        status: JobStatus,
        platform: Platform,
        log_dir: Path | None,
        stored: _Stored | None = None,
    ) -> JobRunner:
        kept = stored or _Stored()
        runner = JobRunner(
            spec, status, bus=self.bus, store=self.store, platform=platform,
            settings=self.settings, log_dir=log_dir, clocks=self.clocks, signer=self.signer,
            after_persist=self.after_persist, revision=kept.revision, epoch=kept.epoch,
            fence=kept.fence, notes=kept.notes, orders=kept.orders,
        )  # fmt: skip
        env_report.EnvironmentReport().attach(runner)
        return runner


@dataclass(frozen=True, slots=True)
class _Stored:
    """What an adopted job's runner continues from (a new job: nothing)."""

    revision: int | None = None
    epoch: int = 0
    fence: Callable[[], None] = no_fence
    notes: job_record.JobNotes | None = None
    orders: tuple[RoundOrder, ...] = ()
