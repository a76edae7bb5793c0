"""Prometheus metrics of the master (the one module that speaks ``prometheus_client``).

Every metric lives in the ``CollectorRegistry`` of one ``MasterMetrics`` (one per service, never
the global registry). ``attach`` hooks a ``JobRunner`` through its observer lists; ``serve``
starts the HTTP exposition on a port. Label ``round`` is the kind of check round
(``bootcheck`` or ``troubleshoot``), not its sequence number (bounded cardinality).
"""

from __future__ import annotations

import errno
import glob
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from aegis.core import actions as act
from aegis.core import events as ev
from aegis.core.incidents import IncidentTracker
from aegis.core.model import PodName
from aegis.core.phases import CHECK_PHASES, TERMINAL_PHASES, Phase
from aegis.core.recovery import LEVEL_NAMES
from aegis.master import node_drains
from aegis.master.job_runner import JobRunner
from aegis.wire import messages as m

log = logging.getLogger(__name__)

CHECK_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 180, 300)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HEARTBEAT_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5,
                           5, 10)  # fmt: skip
ROUND_NAMES = {Phase.BOOT_CHECKING: "bootcheck", Phase.TROUBLESHOOTING: "troubleshoot"}
JOB_LABELS = ("gpu_type", "worker_num")


def host_gpu_type() -> str:
    """The GPU model of this host from the NVIDIA driver's proc files; ``cpu`` when none."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as lines:
                for line in lines:
                    if line.startswith("Model:"):
                        return line.split(":", 1)[1].strip().replace(" ", "_")
        except OSError:
            continue
    return "cpu"


@dataclass(slots=True)
class _Job:
    runner: JobRunner
    labels: tuple[str, str]  # gpu_type, worker_num
    tracker: IncidentTracker
    phase: Phase
    phase_since: float
    fault_latency: dict[PodName, tuple[str, float]] = field(default_factory=dict)


class _LiveCollector(Collector):
    """Values read from the runners at scrape time: drops, pods by inner phase, jobs by phase."""

    def __init__(self, jobs: list[_Job]) -> None:
        self.jobs = jobs

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        drops = CounterMetricFamily(
            "aegis_messages_dropped",
            "Agent messages the master dropped, by reason",
            labels=["reason"],
        )
        totals: dict[str, int] = {}
        pods: dict[str, int] = {phase.value: 0 for phase in Phase}
        jobs: dict[str, int] = {phase.value: 0 for phase in Phase}
        for job in self.jobs:
            for reason, count in job.runner.drops.counts.items():
                totals[reason] = totals.get(reason, 0) + count
            jobs[job.runner.status.phase.value] += 1
            if job.runner.status.phase in TERMINAL_PHASES:
                continue
            for info in job.runner.status.pod_infos.values():
                pods[info.inner_phase.value] += 1
        for reason, count in sorted(totals.items()):
            drops.add_metric([reason], count)
        yield drops
        by_phase = GaugeMetricFamily(
            "aegis_pods", "Pods of running jobs by inner phase", labels=["inner_phase"]
        )
        for phase, count in pods.items():
            by_phase.add_metric([phase], count)
        yield by_phase
        job_phase = GaugeMetricFamily("aegis_jobs", "Jobs by phase", labels=["phase"])
        for phase, count in jobs.items():
            job_phase.add_metric([phase], count)
        yield job_phase
        yield self._straggler_scores()

    def _straggler_scores(self) -> GaugeMetricFamily:
        """Each node's straggler score (core/stragglers.py) in the running jobs' current round:
        how many steps its pod ends its steps after its peers (median over recent windows)."""
        scores = GaugeMetricFamily(
            "aegis_straggler_score",
            "Steps by which the node's pod ends its training steps after its peers' (median "
            "over recent windows of the current round; about 0 for all but a straggler)",
            labels=["node"],
        )
        for job in self.jobs:
            runner = job.runner
            if runner.status.phase is not Phase.RUN_COMMAND:
                continue
            nodes = runner.pod_nodes()
            for pod, score in sorted(runner.stragglers.scores().items()):
                scores.add_metric([nodes.get(PodName(pod), "?")], score)
        return scores


class MasterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.check_duration = Histogram(
            "aegis_check_duration_seconds", "Duration of one check on one pod",
            ["check", "gpu_type", "worker_num", "round"], buckets=CHECK_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.round_duration = Histogram(
            "aegis_round_duration_seconds", "Duration of a whole bootcheck or troubleshoot round",
            ["round", "gpu_type", "worker_num"], buckets=CHECK_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.check_failures = Counter(
            "aegis_check_failures", "Failed checks", ["check", "gpu_type", "worker_num", "round"],
            registry=r,
        )  # fmt: skip
        self.jobs_created = Counter("aegis_jobs_created", "Jobs created", JOB_LABELS, registry=r)
        self.jobs_succeeded, self.jobs_failed = (
            Counter(f"aegis_jobs_{name}", f"Jobs that ended {phase}", JOB_LABELS, registry=r)
            for name, phase in (("succeeded", "Succeed"), ("failed", "Failed"))
        )
        self.recoveries = Counter(
            "aegis_recoveries", "Incidents recovered, by the highest recovery level used",
            ["level"], registry=r,
        )  # fmt: skip
        self.faults = Counter(
            "aegis_faults", "Faults seen, by detector and whether they spent budget",
            ["detector", "counted"], registry=r,
        )  # fmt: skip
        self.detection_latency = Histogram(
            "aegis_fault_detection_latency_seconds",
            "From the fault (agent report time, or last progress for a hang, or last heartbeat) "
            "to the master handling it", ["detector"], buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.incident_duration = Histogram(
            "aegis_recovery_duration_seconds", "From detection until back in RunCommand",
            ["level"], buckets=LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.hang_suspects = Counter(
            "aegis_hang_suspects", "Hangs judged from every pod's stacks, by the node of the pod "
            "named (\"none\": the stacks singled out nobody)", ["node"], registry=r,
        )  # fmt: skip
        self.heartbeat_lag = Histogram(
            "aegis_heartbeat_lag_seconds",
            "From an agent sending a heartbeat (its timestamp) to the master handling it",
            buckets=HEARTBEAT_LAG_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.persist_failures = Counter(
            "aegis_checkpoint_persist_failures", "Failed attempts of a pod's saver daemon to "
            "persist a checkpoint to its durable directory, by errno name (ENOSPC, EROFS, ...; "
            "other: a number this host has no name for)", ["errno"], registry=r,
        )  # fmt: skip
        self.health_drains = Counter(
            "aegis_health_drains", "Nodes a job moved off because their GPUs showed warning "
            "signs (the agents' health watch), by node", ["node"], registry=r,
        )  # fmt: skip
        for level in LEVEL_NAMES.values():
            self.recoveries.labels(level)
        self.jobs: list[_Job] = []
        r.register(_LiveCollector(self.jobs))

    # -- hooks ---------------------------------------------------------------------------------

    def attach(self, runner: JobRunner, *, gpu_type: str = "cpu") -> None:
        labels = (gpu_type, str(runner.spec.worker_num))
        job = _Job(runner, labels, IncidentTracker(runner.spec.job), runner.status.phase,
                   runner.clock())  # fmt: skip
        self.jobs.append(job)
        self.jobs_created.labels(*labels).inc()
        self.jobs_succeeded.labels(*labels)  # present (at 0) from the start, for rates
        self.jobs_failed.labels(*labels)
        runner.message_listeners.append(lambda r, msg: self._on_message(job, msg))
        runner.heartbeat_listeners.append(self._on_heartbeat)
        runner.listeners.append(lambda r, event, actions: self._on_event(job, event, actions))

    def detach(self, runner: JobRunner) -> None:
        """Forget a finished job's live values (its counters stay)."""
        self.jobs[:] = [job for job in self.jobs if job.runner is not runner]

    def _on_heartbeat(self, runner: JobRunner, msg: m.Message) -> None:
        self.heartbeat_lag.observe(max(0.0, runner.clock() - msg.ts))

    def _on_message(self, job: _Job, msg: m.Message) -> None:
        now = job.runner.clock()
        match msg.data:
            case m.ChecksData(response=response):
                kind = ROUND_NAMES.get(msg.phase, msg.phase.value)
                for result in response.results:
                    labels = (result.check_type.value, *job.labels, kind)
                    self.check_duration.labels(*labels).observe(result.duration_s)
                    if not result.passed:
                        self.check_failures.labels(*labels).inc()
            case m.ErrorData():
                job.fault_latency[PodName(msg.pod)] = ("error", max(0.0, now - msg.ts))
            case m.HangData(idle_s=idle_s):
                job.fault_latency[PodName(msg.pod)] = ("hang", idle_s + max(0.0, now - msg.ts))
            case m.CheckpointStoreData(ok=False, errno=code, failures=failures):
                name = errno.errorcode.get(code, "other")  # a peer's number: no new series
                self.persist_failures.labels(name).inc(max(failures, 0))
            case _:
                pass

    def _on_event(self, job: _Job, event: ev.Event, actions: tuple[act.Action, ...]) -> None:
        runner, now = job.runner, job.runner.clock()
        self._count_by_node(job, event, actions)
        for action in actions:
            match action:
                case act.RecordFault(pod=pod, counted=counted):
                    detector, latency = self._detection(job, event, pod)
                    self.faults.labels(detector, str(counted).lower()).inc()
                    if latency is not None:
                        self.detection_latency.labels(detector).observe(latency)
                case act.EndJob(phase=Phase.SUCCEED):
                    self.jobs_succeeded.labels(*job.labels).inc()
                case act.EndJob(phase=Phase.FAILED):
                    self.jobs_failed.labels(*job.labels).inc()
                case _:
                    pass
        closed = job.tracker.feed(job.phase, event, runner.status, actions, now).closed
        if closed is not None and closed.outcome is Phase.RUN_COMMAND and closed.level_name:
            self.recoveries.labels(closed.level_name).inc()
            self.incident_duration.labels(closed.level_name).observe(now - closed.opened_ts)
        if runner.status.phase is not job.phase:
            if job.phase in CHECK_PHASES:
                kind = ROUND_NAMES[job.phase]
                self.round_duration.labels(kind, *job.labels).observe(now - job.phase_since)
            job.phase, job.phase_since = runner.status.phase, now

    def _count_by_node(self, job: _Job, event: ev.Event, actions: tuple[act.Action, ...]) -> None:
        """The counters by node: hangs judged (the node of the pod named), health drains."""
        if isinstance(event, ev.HangReported) and any(
            isinstance(a, act.RecordFault) for a in actions
        ):
            info = job.runner.status.pod_infos.get(event.pod)
            node = str(info.node) if event.blame and info is not None else "none"
            self.hang_suspects.labels(node).inc()
        if isinstance(event, ev.NodeDown) and event.reason.startswith(node_drains.HEALTH_REASON):
            for action in actions:
                if isinstance(action, act.BlacklistNode):  # (once: ErrorNodes has it now)
                    self.health_drains.labels(action.node).inc()

    @staticmethod
    def _detection(job: _Job, event: ev.Event, pod: PodName) -> tuple[str, float | None]:
        match event:
            case ev.HeartbeatLost():
                seen = job.runner.liveness.last_seen.get(pod)
                return "heartbeat", (time.monotonic() - seen) if seen is not None else None
            case ev.PodRestarted():
                return "platform", None
            case ev.HangReported():  # the pod named may be one that never reported
                return "hang", job.fault_latency.pop(pod, ("hang", None))[1]
            case ev.PodErrored() | ev.PodFinished():
                kind, latency = job.fault_latency.pop(pod, ("exit", 0.0))
                return kind, latency
            case _:
                return type(event).__name__, None

    # -- exposition ----------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` on ``addr:port`` (port 0: any free port) in a daemon thread."""
        server, thread = prometheus_client.start_http_server(port, addr, registry=self.registry)
        log.info("metrics on http://%s:%d/metrics", addr, server.server_port)
        return MetricsServer(server, thread)

    def scrape(self) -> str:
        return prometheus_client.generate_latest(self.registry).decode()


@dataclass(frozen=True, slots=True)
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
