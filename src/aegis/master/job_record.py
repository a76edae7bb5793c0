"""A job's record in the status bucket: one JSON object per job, written by whoever submits the
job, then only by its leader (revision-checked), read back by a new leader, by every replica's
credentials handshake and by ``aegis status --nats``.

Its fields: ``spec`` and ``status`` as ``wire.status_json`` writes them (the status file's
shape), the round's ``orders`` with their environment (a new leader sends them again), the
leader's ``epoch``, and the master's notes (``JobNotes``). A field at its default is left out,
as the records written before this struct left out what they did not have yet; unknown fields
are ignored, so a record of another version of Aegis is read as well as it can be.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from aegis.core.model import JobSpec, JobStatus
from aegis.master.pace import PaceNotes
from aegis.master.round_orders import RoundOrder
from aegis.master.safe_point_notes import SafePointNotes
from aegis.wire import status_json


class JobNotes(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the master keeps with a job besides its status and orders."""

    token: str = ""  # the job's secret (the credentials handshake); "" unknown
    nodes: list[str] = msgspec.field(default_factory=list)  # as submitted, by rank
    hardware_rescheduled: int = 0  # level-3 evictions: the K of ``aegis status --nats``
    committed_step: int = -1  # the newest step every pod committed (-1: none yet)
    watchdogs: dict[str, str] = msgspec.field(default_factory=dict)  # pod -> hang timeout
    # the straggler scores of the round (``pace.StragglerWatch.summary``; empty: none yet)
    stragglers: dict[str, Any] = msgspec.field(default_factory=dict)
    ended: str = ""  # why the job ended, in the master's words (the EndJob reason; "": it runs)
    # ended, and the end's orders and platform call maybe not carried out yet (a new leader
    # carries them out: the old one may have died between the write and the acts)
    end_pending: bool = False
    # the save cadence and the waits for a save, for a new leader (None: an older record)
    safe_points: SafePointNotes | None = None
    # the pace watch's round, its best pace and world, for a new leader (None: an older record)
    pace: PaceNotes | None = None


class JobRecord(JobNotes, kw_only=True, omit_defaults=True):
    spec: dict[str, Any]
    status: dict[str, Any]
    orders: list[RoundOrder] = msgspec.field(default_factory=list)
    epoch: int = 0

    def job(self) -> tuple[JobSpec, JobStatus]:
        """The spec and status; ``KeyError``/``ValueError``/``TypeError`` on another shape."""
        return status_json.from_dict({"spec": self.spec, "status": self.status})

    @property
    def notes(self) -> JobNotes:
        return JobNotes(**{name: getattr(self, name) for name in JobNotes.__struct_fields__})


def build(
    spec: JobSpec,
    status: JobStatus,
    notes: JobNotes,
    orders: Iterable[RoundOrder] = (),
    epoch: int = 0,
) -> JobRecord:
    shape = status_json.to_dict(spec, status)
    return JobRecord(spec=shape["spec"], status=shape["status"], orders=list(orders),
                     epoch=epoch, **msgspec.structs.asdict(notes))  # fmt: skip


_decoder = msgspec.json.Decoder(JobRecord)


def encode(record: JobRecord) -> bytes:
    return msgspec.json.encode(record)


def decode(raw: bytes) -> JobRecord:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) for bytes that are no job record."""
    return _decoder.decode(raw)
