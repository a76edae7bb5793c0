"""The drains of the master's Kubernetes side: ``aegis ctl drain NODE`` is recorded in the
master's store (``master.drained_nodes``); ``Drains`` applies that record to the cluster.

A node drained is listed (``drained``, which every AegisJob's ``.status.drained_nodes`` shows:
the operator keeps replacements off it, as off an ErrorNode) and, with ``cordon`` (``aegis
master --cordon-drained``, which needs the right to patch nodes), cordoned and marked as
Aegis's. A node undrained is uncordoned (Aegis's cordon only) and unlisted. A cordon that fails
(no right to patch nodes, no such node) is logged and the node still listed; an uncordon that
fails is tried again at the next reconcile. With the record in the store and the mark on the
node, a new leader does the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from aegis.platforms.kubernetes import crd_status

log = logging.getLogger(__name__)


class DrainedRecord(Protocol):
    """Where ``aegis ctl drain`` records drained nodes (``master.drained_nodes``)."""

    async def load(self) -> dict[str, str]: ...


class Cordons(Protocol):
    """The cordon of a node (``master_side.JobsApi`` has it)."""

    async def cordon_node(self, node: str) -> bool:
        """Cordon the node (marked as Aegis's); True when Aegis's cordon is on it now, False
        when someone else's was there already."""
        ...

    async def uncordon_node(self, node: str) -> None:
        """Lift Aegis's cordon (a cordon not marked as Aegis's stays)."""
        ...


class Drains:
    def __init__(
        self, api: Cordons, record: DrainedRecord, *, cordon: bool, clock: Callable[[], float]
    ) -> None:
        self.api, self.record, self.cordon, self.clock = api, record, cordon, clock
        self.drained: dict[str, crd_status.DrainedNode] = {}  # as applied this term
        self._uncordon_failed: set[str] = set()  # said once, tried again every reconcile

    async def reconcile(self) -> bool:
        """Apply the record (see the module); True when the drained nodes changed."""
        wanted = await self.record.load()
        changed = False
        for node, reason in sorted(wanted.items()):
            if node not in self.drained:
                await self._drain(node, reason)
                changed = True
        for node in [n for n in self.drained if n not in wanted]:
            changed = await self._undrain(node) or changed
        return changed

    def clear(self) -> None:
        """A leadership term ended: the next one applies the record again."""
        self.drained.clear()

    async def _drain(self, node: str, reason: str) -> None:
        self.drained[node] = crd_status.DrainedNode(reason, self.clock())
        cordoned = self.cordon and await self._cordon(node)
        self.drained[node] = crd_status.DrainedNode(reason, self.clock(), cordoned)
        log.warning("kubernetes: node %s drained (%s)%s", node, reason,
                    ", cordoned" if cordoned else "")  # fmt: skip

    async def _undrain(self, node: str) -> bool:
        if self.cordon or self.drained[node].cordoned:
            try:
                await self.api.uncordon_node(node)
            except Exception as exc:
                level = logging.DEBUG if node in self._uncordon_failed else logging.WARNING
                self._uncordon_failed.add(node)
                log.log(level, "kubernetes: uncordoning %s failed (%s); trying again at the "
                        "next poll", node, exc)  # fmt: skip
                return False
        self._uncordon_failed.discard(node)
        del self.drained[node]
        log.warning("kubernetes: node %s undrained", node)
        return True

    async def _cordon(self, node: str) -> bool:
        try:
            return await self.api.cordon_node(node)
        except Exception as exc:
            log.warning("kubernetes: cordoning drained node %s failed (%s); its pods are still "
                        "kept off it through the AegisJobs", node, exc)  # fmt: skip
            return False
