"""When the agent tells the master that the training will not answer its checkpoint request
(pure: the link polls the progress file and sends the refusal).

A script that keeps stepping without ever calling ``save_if_requested`` (two steps past the one
it was at when asked) will not answer; nor will one that has never reported a step and says
nothing for ``decline_after_s``. A script that reported steps before is given the time it needs
to start again: the request often comes with a restart, and a slow node restarts slowly."""

from __future__ import annotations

STEPS_PAST = 2  # steps made after the request without taking it


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
