"""What the world may do to a job at any point: the environment of the model checker.

Every pod may ACK, answer (pass or fail, healthy/hardware/runtime/slow), error (a software
error, the same one at the same step, a peer's closed connection at that step), report a hang,
lose its heartbeat or restart, not come back in time (or its node be found down while it is
away), or be drained (and the drain's deadline pass); any message may come again (duplicate)
or carry the previous or the next round's seq (stale, forged); the user may quit; a checkpoint
may commit. Disruptive events spend a bounded fault budget so that the space stays finite
(drains too, one at a time). Cooperative events (what a healthy cluster does next) are
flagged: with only those, every job must reach Succeed or Failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from aegis.core import events as ev
from aegis.core.model import JobStatus, PodInfo
from aegis.core.phases import Phase
from aegis.core.recovery import SOFTWARE_FAULT_CLASSES, Classification, FaultClass


@dataclass(frozen=True, slots=True)
class Move:
    event: ev.Event
    fault: bool  # spends one unit of the fault budget when it changes the status
    cooperative: bool  # what a healthy cluster would do next


_UNHEALTHY = (Classification.HARDWARE, Classification.RUNTIME, Classification.SLOW)


def moves(status: JobStatus, *, faults_left: int) -> Iterator[Move]:
    """Every event the environment may deliver in ``status``."""
    phase, seq = status.phase, status.seq
    seqs = (seq - 1, seq, seq + 1) if seq > 0 else (seq, seq + 1)
    faults = faults_left > 0
    for pod, info in status.pod_infos.items():
        yield Move(ev.PodAcked(pod), fault=False, cooperative=_acks(status, info))
        awaiting = info.inner_phase is Phase.RESTARTING and not info.finished
        if awaiting or faults:
            yield Move(ev.PodRestarted(pod), fault=not awaiting, cooperative=awaiting)
        if awaiting and faults:  # the platform finds the node it left down
            yield Move(ev.NodeDown(info.node), fault=True, cooperative=False)
        if faults:
            yield Move(ev.HeartbeatLost(pod), fault=True, cooperative=False)
            if not info.finished:  # a pod away that does not come back in time
                yield Move(ev.JoinTimedOut(pod), fault=True, cooperative=False)
            if status.drain_count == 0:  # one drain at a time (bounds the space)
                yield Move(ev.DrainRequested((pod,)), fault=True, cooperative=False)
        if info.drain:  # the drain's deadline passes
            yield Move(ev.DrainForced((pod,)), fault=False, cooperative=True)
        for s in seqs:
            current = s == seq and not info.finished and info.inner_phase is phase
            yield Move(
                ev.PodFinished(pod, phase, s, 0),
                fault=False,
                cooperative=current and phase is Phase.RUN_COMMAND,
            )
            yield Move(
                ev.ChecksReported(pod, phase, s, Classification.HEALTHY),
                fault=False,
                cooperative=current and phase in (Phase.BOOT_CHECKING, Phase.TROUBLESHOOTING),
            )
            if not faults:
                continue
            yield Move(ev.PodFinished(pod, phase, s, 1), fault=True, cooperative=False)
            yield Move(ev.PodErrored(pod, phase, s, "error"), fault=True, cooperative=False)
            for cls in sorted(SOFTWARE_FAULT_CLASSES):  # restarts without checks
                software = ev.PodErrored(pod, phase, s, "exception", cls)
                yield Move(software, fault=True, cooperative=False)
                # the same error at the same step again and again: restart or stop
                repeated = ev.PodErrored(pod, phase, s, "exception", cls, step=7)
                yield Move(repeated, fault=True, cooperative=False)
            # a peer's crash at that step, seen as a closed connection: it continues the run
            peer = ev.PodErrored(pod, phase, s, "closed", FaultClass.CONNECTION, step=7)
            yield Move(peer, fault=True, cooperative=False)
            yield Move(ev.HangReported(pod, phase, s), fault=True, cooperative=False)
            unnamed = ev.HangReported(pod, phase, s, "hang, no suspect", blame=False)
            yield Move(unnamed, fault=True, cooperative=False)
            for verdict in _UNHEALTHY:
                yield Move(
                    ev.ChecksReported(pod, phase, s, verdict, verdict.value),
                    fault=True,
                    cooperative=False,
                )
    if faults and phase is Phase.RUN_COMMAND:  # the pace watch sees training slow down
        yield Move(ev.SlowdownReported(), fault=True, cooperative=False)
    yield Move(ev.CheckpointCommitted(step=0), fault=False, cooperative=True)
    yield Move(ev.QuitRequested(), fault=False, cooperative=False)


def _acks(status: JobStatus, info: PodInfo) -> bool:
    if info.inner_phase is not Phase.PENDING:
        return False
    return not (status.phase is Phase.PENDING and info.finished)
