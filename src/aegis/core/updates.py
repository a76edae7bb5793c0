"""Fast immutable updates of ``PodInfo`` and ``JobStatus`` (``dataclasses.replace`` is several
times slower on the hot path of ``step``)."""

from __future__ import annotations

import enum

import immutables

from aegis.core.model import ErrorNode, JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import Phase
from aegis.core.recovery import Classification, RecoveryLevel

PodMap = immutables.Map[PodName, PodInfo]


class Keep(enum.Enum):
    KEEP = "keep"


KEEP = Keep.KEEP


def pod(  # noqa: PLR0913 (one optional keyword per field it may replace)
    info: PodInfo,
    *,
    inner: Phase | None = None,
    finished: bool | None = None,
    retries: int | None = None,
    reason: str | None = None,
    ts: float | None = None,
    seq: int | None = None,
    verdict: Classification | Keep | None = KEEP,
    evict: RecoveryLevel | Keep | None = KEEP,
    slow: bool | None = None,
    drain: bool | None = None,
    node: NodeName | None = None,
    pod_ip: str | None = None,
) -> PodInfo:
    return PodInfo(
        inner_phase=info.inner_phase if inner is None else inner,
        node=info.node if node is None else node,
        pod_ip=info.pod_ip if pod_ip is None else pod_ip,
        finished=info.finished if finished is None else finished,
        retries=info.retries if retries is None else retries,
        last_failed_reason=info.last_failed_reason if reason is None else reason,
        updated_ts=info.updated_ts if ts is None else ts,
        seq=info.seq if seq is None else seq,
        verdict=info.verdict if isinstance(verdict, Keep) else verdict,
        evict=info.evict if isinstance(evict, Keep) else evict,
        slow=info.slow if slow is None else slow,
        drain=info.drain if drain is None else drain,
    )


def status(  # noqa: PLR0913 (one optional keyword per field it may replace)
    status: JobStatus,
    *,
    phase: Phase | None = None,
    recover_count: int | None = None,
    should_quit: bool | None = None,
    seq: int | None = None,
    pod_infos: PodMap | None = None,
    error_nodes: tuple[ErrorNode, ...] | None = None,
    outstanding: int | None = None,
    away: int | None = None,
    slow_count: int | None = None,
    drain_count: int | None = None,
    repeat_step: int | None = None,
    repeat_reason: str | None = None,
    repeat_count: int | None = None,
) -> JobStatus:
    return JobStatus(
        phase=status.phase if phase is None else phase,
        recover_count=status.recover_count if recover_count is None else recover_count,
        should_quit=status.should_quit if should_quit is None else should_quit,
        seq=status.seq if seq is None else seq,
        pod_infos=status.pod_infos if pod_infos is None else pod_infos,
        error_nodes=status.error_nodes if error_nodes is None else error_nodes,
        outstanding=status.outstanding if outstanding is None else outstanding,
        away=status.away if away is None else away,
        slow_count=status.slow_count if slow_count is None else slow_count,
        drain_count=status.drain_count if drain_count is None else drain_count,
        repeat_step=status.repeat_step if repeat_step is None else repeat_step,
        repeat_reason=status.repeat_reason if repeat_reason is None else repeat_reason,
        repeat_count=status.repeat_count if repeat_count is None else repeat_count,
    )
