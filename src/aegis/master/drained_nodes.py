"""The nodes ``aegis ctl drain`` took out of service, for a standalone master (``aegis master``).

A drain reaches the platforms of the jobs the leader runs at that moment; a job adopted later,
or the jobs of the next leader, must learn it too ("never scheduled again until undrain"). The
record is one key of its own bucket, a JSON map node -> reason, changed with a revision-checked
write (tried again on a conflict). To ``control`` it is one more platform: its ``drain_node`` and
``undrain_node`` keep the record; the replica tells every job it adopts (``RemotePlatform``'s
DRAIN request for each recorded node).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from aegis.adapters.ports import StatusStore, StoreConflictError

BUCKET = "aegis-drained"
KEY = "nodes"
TRIES = 10


class DrainedNodes:
    def __init__(self, store: StatusStore) -> None:
        self.store = store
        self.blacklist: dict[str, str] = {}  # control's NodeBlacklist (the record is the store)

    async def load(self) -> dict[str, str]:
        """Every drained node and its reason."""
        got = await self.store.get(KEY)
        return _decode(got[0]) if got else {}

    async def drain_node(self, node: str, reason: str) -> None:
        await self._change(lambda nodes: nodes.__setitem__(node, reason))

    async def undrain_node(self, node: str) -> None:
        await self._change(lambda nodes: nodes.pop(node, None))

    async def _change(self, change: Callable[[dict[str, str]], object]) -> None:
        for _ in range(TRIES):
            got = await self.store.get(KEY)
            nodes = _decode(got[0]) if got else {}
            change(nodes)
            body = json.dumps(nodes, sort_keys=True).encode()
            try:
                await self.store.put(KEY, body, expected_revision=got[1] if got else None)
                return
            except StoreConflictError:
                continue  # another write came between: read it and apply ours again
        raise StoreConflictError("conflict", detail=f"{BUCKET}/{KEY}: {TRIES} tries")


def _decode(raw: bytes) -> dict[str, str]:
    try:
        found = json.loads(raw)
    except ValueError:
        return {}  # an unreadable record drains nothing (and is rewritten by the next change)
    if not isinstance(found, dict):
        return {}
    return {str(node): str(reason) for node, reason in found.items()}
