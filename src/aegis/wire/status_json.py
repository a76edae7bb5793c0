"""The status file (``{"spec": ..., "status": ...}``) with the field names of DESIGN section 3."""

from __future__ import annotations

from typing import Any

from aegis.core import model
from aegis.core.model import JobSpec, JobStatus


def to_dict(spec: JobSpec, status: JobStatus) -> dict[str, Any]:
    pods = model.pods_by_rank(status)
    return {
        "spec": {
            "job": spec.job,
            "namespace": spec.namespace,
            "worker_num": spec.worker_num,
            "max_retry": spec.max_retry,
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
                }
                for pod, info in pods
            },
            "error_nodes": [
                {"node": e.node, "reason": e.reason, "ts": e.ts} for e in status.error_nodes
            ],
        },
    }
