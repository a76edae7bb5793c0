"""What a job runner is given besides its job: its settings, its two clocks, the hook called
after each status write, and the error a deposed leader's runner raises."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aegis.core import rendezvous, stragglers
from aegis.core.errors import LocalError
from aegis.core.model import JobSpec, JobStatus
from aegis.master.hang_judge import GatherSettings
from aegis.master.pace import PaceSettings

Clock = Callable[[], float]
# Called with the status just written, before its orders go out (a failover test's chaos: the
# harness that wants a master to die there supplies it; nothing in the runner decides to).
AfterPersist = Callable[[JobStatus], None]


class LeadershipLostError(LocalError):
    """This replica no longer holds the lease: it must not write or send anything."""


def no_fence() -> None:
    """The fence of a master that holds no lease (one master, no replicas): never raises."""


@dataclass(frozen=True, slots=True)
class Clocks:
    """``wall``: timestamps of the event log, the orders and the observers; ``mono``: the
    heartbeats, deadlines and the pace (never wall time)."""

    wall: Clock = time.time
    mono: Clock = time.monotonic


@dataclass(frozen=True, slots=True)
class JobSettings:
    heartbeat_timeout_s: float = 5.0
    # A pod sent away that has not ACKed again after this long: its node is blacklisted and
    # the pod placed elsewhere (``master/liveness.py``); long enough for a pod to be scheduled
    # and its image pulled.
    join_timeout_s: float = 600.0
    order_resend_s: float = 5.0
    # Where a round's ranks meet (core/rendezvous.py): rank 0's pod address, and a port from
    # the range its pod owns (or, the default, one free on the one host every pod shares).
    rendezvous: rendezvous.RendezvousRule = field(default_factory=rendezvous.RendezvousRule)
    # Checkpoint on request: asked for when a pod is draining, and when one is marked slow
    # (so it leaves at the next step boundary, not at the next periodic checkpoint).
    checkpoint_on_slow: bool = True
    checkpoint_lead_s: float = 2.0  # the requested step lies this far ahead of the estimate
    checkpoint_hold_s: float = 30.0  # ranks hold after saving, at most this long
    drain_deadline_s: float = 60.0  # default wait for the commit before a drain evicts anyway
    # The pace watch (master/pace.py): a run that slows well below its own pace gets the checks.
    pace: PaceSettings = field(default_factory=PaceSettings)
    # Straggler scores from the pods' step ends (core/stragglers.py); they name the pace
    # watch's slow node, and are exported by the metrics.
    stragglers: stragglers.StragglerSettings = field(default_factory=stragglers.StragglerSettings)
    # A hang is judged from every pod's report of it (master/hang_judge.py).
    hang_gather: GatherSettings = field(default_factory=GatherSettings)


def status_key(spec: JobSpec) -> str:
    """The job's key in the status bucket."""
    return f"{spec.namespace}.{spec.job}"
