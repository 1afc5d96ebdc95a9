"""Lease ends wake a replica's scheduling cycle only while jobs wait, and reach it only then.

Every lease end is published for operators (``subjects.ALLOC_ENDED``) and every replica could
listen to all of them, but one matters to a scheduler only while some job waits for the capacity
it frees: otherwise placement on admission grants what arrives and nothing is woken
(``handlers.wake_for_capacity``). A replica subscribed for good would still be delivered every
lease end of the pool, one more message per job for each replica. So ``cycle_loop`` follows the
subject from the moment it sees jobs waiting, before the cycle that reads the pool, and stops once
none wait: a lease that ended before the subscription is in that cycle's read, and one that ends
after it wakes the next cycle. ``cycle_loop``'s periodic wake still finds whatever a lost message
leaves behind.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Any, Final

from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import FlushTimeoutError

from xpupool.bus.connection import round_trip
from xpupool.contracts import subjects

FLUSH_TIMEOUT_S: Final = 1
"""How long each of ``follow``'s two flushes waits for the server to confirm the subscription:
a cycle must not stall on a connection that is reconnecting."""


class CapacityWatch:
    """The lease-end subscription of one replica, on its current NATS connection."""

    def __init__(self, nc: Nats, on_capacity: Callable[[], None]) -> None:
        self._nc = nc
        self._on_capacity = on_capacity
        self._subscription: Any = None

    @property
    def following(self) -> bool:
        """Whether lease ends are delivered to this replica now."""
        return self._subscription is not None

    async def follow(self) -> None:
        """Be woken by every lease end from now on (jobs wait): once this returns, the server
        has the subscription (one round trip, only when it was not followed yet), or the
        connection is down for longer than ``FLUSH_TIMEOUT_S`` and the client sends it again
        on reconnecting (a lease end meanwhile is left to the periodic wake)."""
        if self._subscription is None:
            self._subscription = await self._nc.subscribe(
                subjects.ALLOC_ENDED.pattern, cb=self._on_message
            )
            with suppress(FlushTimeoutError):
                # Not a bare flush: nats-py's PING can overtake the SUB (``round_trip``).
                await round_trip(self._nc, FLUSH_TIMEOUT_S)

    async def rest(self) -> None:
        """Stop being delivered lease ends (no job waits)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            await subscription.unsubscribe()

    async def _on_message(self, _: Msg) -> None:
        self._on_capacity()
