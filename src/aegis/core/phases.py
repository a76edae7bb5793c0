"""Phases of a job (global) and of a pod (inner phase): one set for both, as in the seed's CR."""

from __future__ import annotations

import enum


class Phase(enum.StrEnum):
    PENDING = "Pending"
    BOOT_CHECKING = "BootChecking"
    RUN_COMMAND = "RunCommand"
    RESTARTING = "Restarting"
    TROUBLESHOOTING = "Troubleshooting"
    SUCCEED = "Succeed"
    FAILED = "Failed"


TERMINAL_PHASES: frozenset[Phase] = frozenset({Phase.SUCCEED, Phase.FAILED})

# Phases in which the master runs a round of checks and waits for every pod's answer.
CHECK_PHASES: frozenset[Phase] = frozenset({Phase.BOOT_CHECKING, Phase.TROUBLESHOOTING})

# For each global phase, the inner phases an *unfinished* pod may be in (PhaseConsistency).
# Pods that left during a check round (replaced or restarted) sit in Restarting/Pending until
# they return: the seed's exemption for predecessor phases.
ALLOWED_UNFINISHED_INNER: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.PENDING, Phase.RESTARTING}),
    Phase.BOOT_CHECKING: frozenset({Phase.BOOT_CHECKING, Phase.PENDING, Phase.RESTARTING}),
    Phase.RUN_COMMAND: frozenset({Phase.RUN_COMMAND}),
    Phase.TROUBLESHOOTING: frozenset({Phase.TROUBLESHOOTING, Phase.PENDING, Phase.RESTARTING}),
    Phase.RESTARTING: frozenset({Phase.RESTARTING, Phase.PENDING}),
    Phase.SUCCEED: frozenset(),
    Phase.FAILED: frozenset(),
}


class Order(enum.StrEnum):
    """What the master tells agents to do."""

    BOOTCHECK = "bootcheck"
    RUN = "run"
    TROUBLESHOOT = "troubleshoot"
    RESTART = "restart"
    STOP = "stop"
    EXIT = "exit"
    CHECKPOINT = "checkpoint"
