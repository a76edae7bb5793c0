"""Messages between a master replica and a platform process (``aegis run --masters N``).

On ``aegis-platform.<namespace>.<job>.requests`` the leader asks for pod work; on
``.events`` the platform reports pods that are up again and nodes it found down (again, on a
new leader's ``resend``: an event published while the leader changed reached no one). The subjects
are outside the job's ``aegis.<namespace>.<job>.>`` space, so a worker's credentials cannot
reach them.
"""

from __future__ import annotations

import enum

import msgspec


class RequestKind(enum.StrEnum):
    REPLACE = "replace"
    EVICT = "evict"
    BLACKLIST = "blacklist"
    END = "end"
    DRAIN = "drain"  # aegis ctl drain: keep pods off the node (and drain it in the scheduler)
    UNDRAIN = "undrain"
    # a new leader, now listening to the job's events: publish again what it may have missed
    # while no replica listened (the nodes found down)
    RESEND = "resend"


class PlatformRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    kind: RequestKind
    key: str  # idempotency key: the same work asked twice (e.g. after a takeover) runs once
    pod: str = ""
    node: str = ""
    level: int = 0
    reason: str = ""
    phase: str = ""
    epoch: int = 0


class PlatformEvent(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    kind: str  # "restarted" | "node_down" | "quit"
    pod: str = ""
    node: str | None = None
    pod_ip: str | None = None
    reason: str = ""


def subject(namespace: str, job: str, what: str) -> str:
    return f"aegis-platform.{namespace}.{job}.{what}"
