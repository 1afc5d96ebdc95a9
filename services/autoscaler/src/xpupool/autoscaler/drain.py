"""Draining a node: the intent the scheduler must honour (no new grants on a draining node).

The autoscaler records every drain in its own state (``autoscaler:nodes``: ``draining_since``)
and announces it (``NodeDraining`` on ``xpupool.scale.v1.draining``); a :class:`NodeDrainer`
carries it to where the scheduler's reserve path reads it. Both calls are idempotent. The
autoscaler also re-checks a node's leases right before it removes it, so a lease granted on a
node before its drain landed keeps that node.
"""

from __future__ import annotations

from typing import Protocol

from xpupool.ledger import Ledger

__all__ = ["LedgerDrainer", "NodeDrainer"]


class NodeDrainer(Protocol):
    """Stops (and resumes) new grants on a node."""

    async def drain(self, node_id: str) -> None:
        """No new grant on ``node_id`` from now on; leases on it run on."""
        ...

    async def undrain(self, node_id: str) -> None:
        """``node_id`` takes grants again."""
        ...


class LedgerDrainer:
    """Drains through the ledger (``Ledger.set_node_draining``), where the reserve path reads
    it. A node the autoscaler drains may not have registered yet (one it gives back for never
    registering by its deadline): the ledger holds the drain for it, so that if it registers
    after all it comes up draining and takes no grant on its way out."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    async def drain(self, node_id: str) -> None:
        await self._set(node_id, True)

    async def undrain(self, node_id: str) -> None:
        await self._set(node_id, False)

    async def _set(self, node_id: str, draining: bool) -> None:
        result = await self._ledger.set_node_draining(node_id, draining, hold_unregistered=True)
        if not result.ok:
            raise RuntimeError(f"ledger refused to set {node_id} draining={draining}: {result}")
