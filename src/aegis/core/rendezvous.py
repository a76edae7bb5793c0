"""Where a round's ranks meet: the endpoint follows rank 0's pod (DESIGN section 4).

Pure: the master's shell calls :func:`endpoint` when it materialises a round's orders. The host is
rank 0's pod address as the platform reported it (a node's address, a pod IP) and, while none is
known, the rule's fallback (a name that follows rank 0 by itself, such as a headless service on
Kubernetes, or the loopback of the one shared host). The port is either taken from a range that
rank 0's pod owns (its own network namespace: a pod IP, an emulated or a real node) or, where
every pod and the master share one host, a port found free on that host by the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aegis.core.model import JobSpec, JobStatus, PodName, pod_names

TORCH_PORT = 29500  # torchrun's default MASTER_PORT: the first of a pod-owned range
PORTS_PER_ROUND = 2  # a round's collective child meets on port, allreduce_perf alone on port + 1


@dataclass(frozen=True, slots=True)
class RendezvousRule:
    """How a platform's pods meet.

    ``fallback_host`` is used while rank 0's pod has no known address; ``{job}`` and
    ``{namespace}`` are filled in. ``port_base`` 0 means "one shared host": the caller probes a
    free port there. Otherwise a round with sequence number ``seq`` meets on
    ``port_base + 2 * (seq % port_span)`` (so a new round never reuses the last one's port, and
    the range stays below Linux's ephemeral ports with the defaults).
    """

    fallback_host: str = "127.0.0.1"
    port_base: int = 0
    port_span: int = 1000

    def __post_init__(self) -> None:
        top = self.port_base + PORTS_PER_ROUND * self.port_span
        if self.port_base < 0 or self.port_span < 1 or top > 65536:
            raise ValueError(f"rendezvous ports {self.port_base}..{top - 1} are not valid ports")


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


def rank0_pod(spec: JobSpec) -> PodName:
    return pod_names(spec)[0]


def host(rule: RendezvousRule, spec: JobSpec, status: JobStatus) -> str:
    """Rank 0's pod address now, or the rule's fallback while none is known."""
    info = status.pod_infos.get(rank0_pod(spec))
    if info is not None and info.pod_ip:
        return info.pod_ip
    return rule.fallback_host.format(job=spec.job, namespace=spec.namespace)


def endpoint(
    rule: RendezvousRule,
    spec: JobSpec,
    status: JobStatus,
    seq: int,
    probe_free_port: Callable[[], int],
) -> Endpoint:
    """The endpoint of round ``seq``; ``probe_free_port`` is asked only in shared-host mode."""
    if rule.port_base == 0:
        port = probe_free_port()
    else:
        port = rule.port_base + PORTS_PER_ROUND * (seq % rule.port_span)
    return Endpoint(host(rule, spec, status), port)
