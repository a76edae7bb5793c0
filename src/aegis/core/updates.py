"""Fast immutable updates of ``PodInfo`` and ``JobStatus``: ``pod(info, finished=True)`` is
``info`` with ``finished`` replaced, every other field kept (``dataclasses.replace`` is much
slower on the hot path of ``step``). The keywords are the fields' names, checked by mypy."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator, Mapping
from typing import Any, TypedDict, Unpack

import immutables

from aegis.core.model import ErrorNode, JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification, RecoveryLevel

PodMap = immutables.Map[PodName, PodInfo]


class PodChanges(TypedDict, total=False):
    """The fields of a ``PodInfo`` that :func:`pod` may replace."""

    inner_phase: Phase
    node: NodeName
    pod_ip: str
    finished: bool
    retries: int
    last_failed_reason: str
    updated_ts: float
    seq: int
    verdict: Classification | None
    evict: RecoveryLevel | None
    slow: bool
    drain: bool


class StatusChanges(TypedDict, total=False):
    """The fields of a ``JobStatus`` that :func:`status` may replace."""

    phase: Phase
    recover_count: int
    should_quit: bool
    seq: int
    pod_infos: PodMap
    error_nodes: tuple[ErrorNode, ...]
    outstanding: int
    away: int
    slow_count: int
    drain_count: int
    repeat_step: int
    repeat_reason: str
    repeat_count: int


_POD_FIELDS = tuple(f.name for f in dataclasses.fields(PodInfo))
_STATUS_FIELDS = tuple(f.name for f in dataclasses.fields(JobStatus))
_pod_values = operator.attrgetter(*_POD_FIELDS)
_status_values = operator.attrgetter(*_STATUS_FIELDS)


def pod(info: PodInfo, **changes: Unpack[PodChanges]) -> PodInfo:
    return PodInfo(*_changed(_POD_FIELDS, _pod_values(info), changes))


def status(status: JobStatus, **changes: Unpack[StatusChanges]) -> JobStatus:
    return JobStatus(*_changed(_STATUS_FIELDS, _status_values(status), changes))


def _changed(names: tuple[str, ...], values: Any, changes: Mapping[str, Any]) -> Iterator[Any]:
    """The ``values`` of the fields ``names``, each replaced by the one in ``changes`` if any."""
    return map(changes.get, names, values)
