"""Draining a node: the intent the scheduler must honour (no new grants on a draining node).

The autoscaler records every drain in its own state (``autoscaler:nodes``: ``draining_since``)
and announces it (``NodeDraining`` on ``xpupool.scale.v1.draining``); a :class:`NodeDrainer`
carries it to where the scheduler's reserve path reads it. Both calls are idempotent.

:class:`LedgerDrainer` calls ``Ledger.set_node_draining(node_id, draining)`` when the ledger has
it (the reserve path's side of issue 12); until it does, a drain is only the autoscaler's own
record and its event, and the autoscaler re-checks a node's leases right before it removes it,
so a lease granted on a draining node keeps that node.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from xpupool.ledger import Ledger
from xpupool.obs import get_logger

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
    """Drains through the ledger's ``set_node_draining`` where it exists (see the module
    docstring)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._warned = False

    def _setter(self) -> Callable[[str, bool], Awaitable[object]] | None:
        setter: Callable[[str, bool], Awaitable[object]] | None = getattr(
            self._ledger, "set_node_draining", None
        )
        if setter is None and not self._warned:
            self._warned = True
            get_logger().warning(
                "drain_not_in_ledger",
                detail="Ledger.set_node_draining is missing: a drain is the autoscaler's record "
                "and NodeDraining event only",
            )
        return setter

    async def drain(self, node_id: str) -> None:
        setter = self._setter()
        if setter is not None:
            await setter(node_id, True)

    async def undrain(self, node_id: str) -> None:
        setter = self._setter()
        if setter is not None:
            await setter(node_id, False)
