"""The status file (``{"spec": ..., "status": ...}``) with the field names of DESIGN section 3."""

from __future__ import annotations

from typing import Any

import immutables

from aegis.core import model
from aegis.core.model import ErrorNode, JobSpec, JobStatus, NodeName, PodInfo, PodName
from aegis.core.phases import TERMINAL_PHASES, Phase
from aegis.core.recovery import Classification, RecoveryLevel


def to_dict(spec: JobSpec, status: JobStatus) -> dict[str, Any]:
    pods = model.pods_by_rank(status)
    return {
        "spec": {
            "job": spec.job,
            "namespace": spec.namespace,
            "worker_num": spec.worker_num,
            "max_retry": spec.max_retry,
            "software_restart": spec.software_restart,
            "repeat_limit": spec.repeat_limit,
        },
        "status": {
            "phase": status.phase.value,
            "recover_count": status.recover_count,
            "should_quit": status.should_quit,
            "seq": status.seq,
            "pod_infos": {
                pod: {
                    "pod_ip": info.pod_ip,
                    "node": info.node,
                    "inner_phase": info.inner_phase.value,
                    "finished": info.finished,
                    "retries": info.retries,
                    "last_failed_reason": info.last_failed_reason,
                    "updated_ts": info.updated_ts,
                    "seq": info.seq,
                    "slow": info.slow,
                    "drain": info.drain,
                    "verdict": info.verdict.value if info.verdict else None,
                    "evict": int(info.evict) if info.evict else None,
                }
                for pod, info in pods
            },
            "error_nodes": [
                {"node": e.node, "reason": e.reason, "ts": e.ts} for e in status.error_nodes
            ],
            # restart or stop: the last counted error at a known step, and its run of repeats
            "repeat": {
                "step": status.repeat_step,
                "reason": status.repeat_reason,
                "count": status.repeat_count,
            },
        },
    }


def from_dict(record: dict[str, Any]) -> tuple[JobSpec, JobStatus]:
    """The inverse of ``to_dict``: a status read back from the store, counters recomputed."""
    spec = JobSpec(**record["spec"])
    raw = record["status"]
    pods: dict[PodName, PodInfo] = {}
    for name, p in raw["pod_infos"].items():
        pods[PodName(name)] = PodInfo(
            inner_phase=Phase(p["inner_phase"]),
            node=NodeName(p["node"]),
            pod_ip=p["pod_ip"],
            finished=p["finished"],
            retries=p["retries"],
            last_failed_reason=p["last_failed_reason"],
            updated_ts=p["updated_ts"],
            seq=p["seq"],
            verdict=Classification(p["verdict"]) if p.get("verdict") else None,
            evict=RecoveryLevel(p["evict"]) if p.get("evict") else None,
            slow=p["slow"],
            drain=p.get("drain", False),  # absent in records of earlier versions
        )
    phase = Phase(raw["phase"])
    repeat = raw.get("repeat") or {}  # absent in records of earlier versions
    infos = list(pods.values())
    away = 0
    if phase is not Phase.PENDING and phase not in TERMINAL_PHASES:
        away = sum(
            1
            for i in infos
            if not i.finished and i.inner_phase in (Phase.PENDING, Phase.RESTARTING)
        )
    status = JobStatus(
        phase=phase,
        recover_count=raw["recover_count"],
        should_quit=raw["should_quit"],
        seq=raw["seq"],
        pod_infos=immutables.Map(pods),
        error_nodes=tuple(
            ErrorNode(NodeName(e["node"]), e["reason"], e["ts"]) for e in raw["error_nodes"]
        ),
        outstanding=sum(1 for i in infos if not i.finished),
        away=away,
        slow_count=sum(1 for i in infos if i.slow),
        drain_count=sum(1 for i in infos if i.drain),
        repeat_step=int(repeat.get("step", -1)),
        repeat_reason=str(repeat.get("reason", "")),
        repeat_count=int(repeat.get("count", 0)),
    )
    return spec, status
