"""When the agent tells the master that the training will not answer its checkpoint request
(pure: the executor looks at the training's progress and sends the refusal).

A script that keeps stepping without ever calling ``save_if_requested`` (two steps past the one
it was at when asked) will not answer; nor will one that has never reported a step and says
nothing for ``decline_after_s``. A script that reported steps before is given the time it needs
to start again: the request often comes with a restart, and a slow node restarts slowly. A
script that said it takes requests is no longer watched.
"""

from __future__ import annotations

import enum

from aegis.agent import ports

STEPS_PAST = 2  # steps made after the request without taking it
REASON = (
    "the training does not take checkpoint requests "
    "(it never calls aegis.checkpoint.save_if_requested)"
)


class Verdict(enum.Enum):
    WAIT = "wait"  # look again later
    TAKEN = "taken"  # the training takes requests: it answers itself
    DECLINED = "declined"  # tell the master it will not


def declines(
    first_step: int | None,
    step: int | None,
    ever_stepped: bool,
    waited_s: float,
    decline_after_s: float,
) -> bool:
    """Whether the training has shown it will not take the request (``first_step``: the step
    it was at when asked, or the first one seen since)."""
    stepping = step is not None and first_step is not None and step >= first_step + STEPS_PAST
    silent = step is None and not ever_stepped and waited_s > decline_after_s
    return stepping or silent


def look(
    first_step: int | None, seen: ports.Progress, waited_s: float, decline_after_s: float
) -> tuple[int | None, Verdict]:
    """One look at the training ``waited_s`` after the request: the step to count from (the
    one it was at when asked, or the first one seen since) and the verdict."""
    if seen.takes_checkpoint_requests:
        return first_step, Verdict.TAKEN
    first = seen.step if first_step is None else first_step
    if declines(first, seen.step, seen.ever_stepped, waited_s, decline_after_s):
        return first, Verdict.DECLINED
    return first, Verdict.WAIT
