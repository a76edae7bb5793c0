"""Durations used by the simulation, decoded strictly from TOML or JSON (``examples/simulate/``).

Every default is an assumption, documented beside it; ``examples/simulate/settings.toml`` repeats
them so that a team can put its own figures in. Durations are float seconds.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from aegis.core.errors import AegisError


class AegisSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What each step of Aegis's recovery costs (DESIGN sections 5-7)."""

    detect_crash_s: float = 5.0  # the agent sees the exit or a known log signature and reports
    detect_hang_s: float = 300.0  # the agent's hang_timeout_s: no progress for this long
    detect_node_lost_s: float = 30.0  # heartbeat timeout: the pod (node) is gone
    troubleshoot_s: float = (
        60.0  # one round of checks, in parallel on every node (typical, < budgets)
    )
    # Level 1: training processes restarted, pods and memory stay. The agent's own overhead is
    # ~6 ms (RESULTS.md, issue 3); the rest is the training script's start (torch import ~1 s
    # measured) and NCCL initialisation at scale (assumed).
    in_place_restart_s: float = 10.0
    container_restart_s: float = 30.0  # level 2: the pod's container restarts on its node
    node_replace_s: float = 120.0  # level 3: a replacement pod on a spare node runs and ACKs
    load_shm_s: float = 10.0  # reload the newest checkpoint from the agent's shared memory
    load_disk_s: float = 60.0  # reload the newest committed checkpoint from durable storage
    persist_s: float = 120.0  # shared memory -> durable storage, in the background


class BaselineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Restart-from-checkpoint without Aegis: what teams do (and Llama 3's reported setting)."""

    detect_s: float = 600.0  # NCCL timeout: every rank waits for the collective to time out
    relaunch_s: float = 120.0  # tear down and relaunch the whole job (Meta reduced job startup)
    load_disk_s: float = 60.0  # load the last durable checkpoint (same storage as Aegis's)


class SimSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    aegis: AegisSettings = msgspec.field(default_factory=AegisSettings)
    baseline: BaselineSettings = msgspec.field(default_factory=BaselineSettings)


class SettingsError(AegisError, ValueError):
    """The settings file cannot be read or does not match the schema."""


def load(path: Path) -> SimSettings:
    """Decode a ``.toml`` or ``.json`` settings file strictly; unknown keys are errors."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read {path}: {exc.strerror}") from None
    try:
        if path.suffix == ".json":
            settings = msgspec.json.decode(raw, type=SimSettings)
        else:
            settings = msgspec.toml.decode(raw, type=SimSettings)
    except msgspec.DecodeError as exc:
        raise SettingsError(f"{path}: {exc}") from None
    _check_non_negative(settings)
    return settings


def _check_non_negative(settings: SimSettings) -> None:
    for group in (settings.aegis, settings.baseline):
        for name in group.__struct_fields__:
            value = getattr(group, name)
            if value < 0:
                raise SettingsError(f"{type(group).__name__}.{name} must be >= 0, got {value}")
