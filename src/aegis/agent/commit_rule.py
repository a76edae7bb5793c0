"""Which commits of the saver daemon the agent reports (pure: the link decides, the executor
tells it which incarnation of the training is the current one).

The saver daemon outlives a restart of the training in place: a slot the abandoned timeline
handed off before the crash may be persisted, and its commit line written, after the new
incarnation started from an earlier step. That commit is not the new timeline's: reported, the
master would count it as this pod's and move the job's committed step to a step the new
timeline has not committed here. Each commit line says the incarnation that saved its slot
(:mod:`aegis.checkpoint.layout`); a commit of an older incarnation than the current one, of a
step past the one the current incarnation resumed from, is dropped. One of an older incarnation
at or below that step is the history both timelines share, and is reported; so is one whose
incarnation is not known (a slot saved by an older Aegis), as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from aegis.autoprogress import RESUME_STEP_VAR


@dataclass(frozen=True, slots=True)
class Current:
    """The current incarnation of the training: its restart count (``AEGIS_RESTART_COUNT``) and
    the step it was told to resume from (``AEGIS_RESUME_STEP``; None: it was told none)."""

    restart_count: int = 0
    resume_step: int | None = None


def resume_step_of(env: Mapping[str, str]) -> int | None:
    """The step an incarnation started with ``env`` resumes from; None where it says none (or
    says it malformed)."""
    text = env.get(RESUME_STEP_VAR, "")
    return int(text) if text.isascii() and text.isdigit() else None


def abandoned(step: int, incarnation: int, current: Current) -> bool:
    """Whether the commit of ``step`` saved by ``incarnation`` (-1: not known) belongs to a
    timeline that a restart abandoned: an older incarnation's, past the step the current one
    resumed from."""
    if current.resume_step is None or incarnation < 0:
        return False
    return incarnation < current.restart_count and step > current.resume_step
