"""The few collectives the checkpoint readers need, over torch.distributed's default group where
it is initialised with more than one rank, and none otherwise. torch is imported inside the
functions, so that ``import aegis.checkpoint`` stays light."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

Loaded = tuple[int, Any] | None  # (step, state), or None: nothing to load


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` alone)."""
    import torch.distributed as dist

    if world() == 1:
        return [value]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, value)
    return out


def broadcast(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    import torch.distributed as dist

    if world() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def step_bound(steps: list[int]) -> int | None:
    """What a rank loads again, given the step each rank loaded (-1: none): at most the oldest
    of them; None when all loaded the same one (agreed)."""
    lowest = min(steps)
    return None if all(step == lowest for step in steps) else lowest


def agree_on_step(load: Callable[[int | None], Loaded]) -> Loaded:
    """Each rank loads the newest step it can (``load(None)``); while the ranks' steps differ,
    a rank newer than the oldest loads again, at most that one (``load(bound)``; -1: nothing),
    and all compare again. The bound only falls, so it ends: at the newest step every rank can
    load, or nothing for all. Every rank must call it (one ``all_gather`` per try, the same
    count on every rank); alone, it is ``load(None)``."""
    loaded = load(None)
    while (bound := step_bound(all_gather(-1 if loaded is None else loaded[0]))) is not None:
        if loaded is not None and loaded[0] > bound:
            back = f"step {bound}" if bound >= 0 else "a fresh start"
            log.warning("checkpoint: a peer cannot load step %d: this rank goes back with it "
                        "to %s", loaded[0], back)  # fmt: skip
            loaded = load(bound)
    return loaded
