"""A job's record in the status bucket: one JSON object per job, written by whoever submits the
job, then only by its leader (revision-checked), read back by a new leader, by every replica's
credentials handshake and by ``aegis status --nats``.

Its fields: ``spec`` and ``status`` as ``wire.status_json`` writes them (the status file's
shape), the round's ``orders`` with their environment (a new leader sends them again), the
leader's ``epoch``, and the master's notes (``JobNotes``). A field at its default is left out,
as the records written before this struct left out what they did not have yet; unknown fields
are ignored, so a record of another version of Aegis is read as well as it can be. Notes a new
leader can go without (``ADVISORY``: it starts them afresh) are dropped, one by one, where they
have another shape: such a record is still adopted (``read``), not skipped as malformed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

from aegis.adapters.nats_auth import CREATION_PATTERN
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
    # the process of the master that created the job (``spawn.owners.process_name``; "" none:
    # submitted to replicas): a new job may take the name once it is known to be gone
    creator: str = ""
    # the id of this creation of the name, in the job's subjects (``nats_auth.new_creation``;
    # "": created by an older version): kept by every leader of the job
    creation: Annotated[str, msgspec.Meta(pattern=CREATION_PATTERN)] = ""
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


# the notes a new leader starts afresh without: the save cadence, the pace watch's round, the
# straggler scores and the watchdogs' words (not the token, the nodes, the committed step, the
# evictions counted or the end: without those the job is not the same job)
ADVISORY = ("safe_points", "pace", "stragglers", "watchdogs")
_ADVISORY_TYPES = {f.name: f.type for f in msgspec.structs.fields(JobRecord) if f.name in ADVISORY}


def read(raw: bytes) -> tuple[JobRecord, tuple[str, ...]]:
    """The record, and the names of the ``ADVISORY`` notes dropped from it because they had
    another shape (a bug, or another version's writer): the rest of the record is kept. Raises
    as ``decode`` where the bytes are no JSON object, or the record's other fields are bad."""
    try:
        return _decoder.decode(raw), ()
    except msgspec.ValidationError:
        shape = msgspec.json.decode(raw)
        if not isinstance(shape, dict) or shape.keys().isdisjoint(ADVISORY):
            raise
    record = msgspec.convert({k: v for k, v in shape.items() if k not in ADVISORY}, JobRecord)
    kept: dict[str, Any] = {}
    for name in ADVISORY:
        if name in shape:
            try:
                kept[name] = msgspec.convert(shape[name], _ADVISORY_TYPES[name])
            except msgspec.ValidationError:
                continue
    dropped = tuple(name for name in ADVISORY if name in shape and name not in kept)
    return msgspec.structs.replace(record, **kept), dropped
