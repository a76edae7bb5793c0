"""Which checks a troubleshooting round runs and their budgets, as a job configures them
(``AegisJob.spec.checks``; the operator hands it to every pod's agent as ``AEGIS_CHECKS``, JSON):

    {"enabled": ["io", "gpu", "allreduce_connect"], "budgets_s": {"io": 60, "gpu": 30}}

``enabled`` (default: all seven) applies to troubleshooting only: bootcheck always runs its two.
A budget not given keeps its default. Every pod of a job gets the same configuration, so the
collective checks stay in step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aegis.core.recovery import CheckType

ENV = "AEGIS_CHECKS"


@dataclass(frozen=True, slots=True)
class ChecksConfig:
    enabled: frozenset[CheckType] | None = None  # None: every check
    budgets_s: Mapping[CheckType, float] = field(default_factory=dict)


def parse(value: Any) -> ChecksConfig:
    """From the decoded object; raises ``ValueError`` saying what is wrong."""
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {type(value).__name__}")
    unknown = set(value) - {"enabled", "budgets_s"}
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
    enabled = None
    if "enabled" in value:
        names = value["enabled"]
        if not isinstance(names, list):
            raise ValueError("enabled: expected a list of check names")
        if not names:  # troubleshooting with no check would restart a broken node in place
            raise ValueError("enabled: name at least one check (or leave it out for all)")
        enabled = frozenset(_check(name, "enabled") for name in names)
    budgets = value.get("budgets_s", {})
    if not isinstance(budgets, dict):
        raise ValueError("budgets_s: expected an object of check name -> seconds")
    parsed: dict[CheckType, float] = {}
    for name, seconds in budgets.items():
        check = _check(name, "budgets_s")
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0:
            raise ValueError(f"budgets_s.{name}: expected seconds above 0, got {seconds!r}")
        parsed[check] = float(seconds)
    return ChecksConfig(enabled, parsed)


def from_env(env: Mapping[str, str]) -> ChecksConfig:
    """``AEGIS_CHECKS`` (absent or empty: the defaults); raises ``ValueError``."""
    raw = env.get(ENV, "").strip()
    if not raw:
        return ChecksConfig()
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV} is not JSON: {exc}") from None
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(f"{ENV}: {exc}") from None


def _check(name: object, where: str) -> CheckType:
    known = {c.value: c for c in CheckType}
    if isinstance(name, str) and name in known:
        return known[name]
    raise ValueError(f"{where}: unknown check {name!r} (one of {', '.join(known)})")
