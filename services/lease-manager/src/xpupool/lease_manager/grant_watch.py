"""Which grants JetStream has stored: a lease's later event waits for its grant, not a copy.

The scheduler answers a grant made on admission before it publishes the grant's event, so a
holder may renew or release before JetStream holds the grant; and with several lease-managers,
a grant one replica's relay holds may be overtaken by a later event another replica publishes
(that first replica stalled or died). The ledger says when either may be so (the grant's outbox
entry is still there, unconfirmed: ``Ledger.unconfirmed_grant``); the lease-manager then
publishes the later event only once it has seen the grant stored, through a
headers-only ordered consumer on the grant subject (``StoredGrants.run``). It follows the
operator's copy, which the scheduler sends after the tenant's own on the same connection
(``subjects.deliveries``): once the operator's copy is stored, the server has taken the
tenant's in ahead of anything published after it, so both streams hold the grant first. A grant
that does not come within ``wait_s`` (its scheduler stalled or died) or a watch that is not
running gets a copy published first instead, with the same ``Nats-Msg-Id``: JetStream keeps one,
while a core NATS subscriber may see both, which is why the copy is the fallback and not the
rule. For the same reason the relay's sweep of the direct outbox deletes a grant entry it finds
here without publishing it again (``handlers.build_events``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from xpupool.bus.envelope import MSG_ID_HEADER
from xpupool.contracts import subjects
from xpupool.lease_manager.metrics import LeaseManagerMetrics
from xpupool.obs import get_logger

GRANT_WAIT_S: Final = 1.0
"""How long a later event waits for its grant to be stored before a copy is published: far
beyond the scheduler's answer-to-publish gap (one turn of its loop), far inside the relay's
sweep of an abandoned grant (``DIRECT_STALE_MS``)."""
KEEP_S: Final = 60.0
"""How long a stored grant is remembered: its entry is confirmed within the direct outbox's or a
relay's linger (50 ms), or published again by a peer after ``DIRECT_STALE_MS`` (10 s) or
``STALE_AFTER_MS`` (15 s)."""
_GRANTED_SUFFIX: Final = ":granted"  # ``dedup_id`` of an AllocationGranted: "<lease>:granted"


class StoredGrants:
    """The lease ids whose ``AllocationGranted`` JetStream stored in the last ``keep_s``."""

    def __init__(
        self,
        wait_s: float = GRANT_WAIT_S,
        keep_s: float = KEEP_S,
        metrics: LeaseManagerMetrics | None = None,
    ) -> None:
        self._wait_s = wait_s
        # Its waits and copies are counted there, and only there (``waits``, ``copies``).
        self._metrics = metrics or LeaseManagerMetrics()
        self._keep_s = keep_s
        self._seen: set[str] = set()
        self._seen_order: deque[tuple[float, str]] = deque()  # (when seen, lease id), oldest first
        # Commands waiting for a grant: True once it is seen stored, False if the watch stops.
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._following = False

    @property
    def waits(self) -> int:
        """Later events that waited for their grant to be seen stored."""
        return self._counted("xpupool_grant_waits_total")

    @property
    def copies(self) -> int:
        """Grants a later event went after a copy of (none came in time, or no watch)."""
        return self._counted("xpupool_grant_copies_total")

    def _counted(self, series: str) -> int:
        return int(self._metrics.registry.get_sample_value(series) or 0)

    @property
    def following(self) -> bool:
        """Whether the watch runs (its consumer was created)."""
        return self._following

    @property
    def waiting(self) -> int:
        """How many grants later events wait for now."""
        return len(self._waiters)

    def seen(self, lease_id: str) -> bool:
        """Whether the grant of ``lease_id`` was seen stored (no wait)."""
        return lease_id in self._seen

    def saw(self, lease_id: str) -> None:
        """JetStream stored the grant of ``lease_id``."""
        now = time.monotonic()
        if lease_id not in self._seen:
            self._seen.add(lease_id)
            self._seen_order.append((now, lease_id))
        waiter = self._waiters.pop(lease_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(True)
        horizon = now - self._keep_s
        while self._seen_order and self._seen_order[0][0] < horizon:
            self._seen.discard(self._seen_order.popleft()[1])

    async def stored(self, lease_id: str) -> bool:
        """Whether the grant of ``lease_id`` is stored, waiting up to ``wait_s`` for it while
        the watch runs; False means: publish a copy of it first (counted in ``copies``)."""
        if lease_id in self._seen:
            return True
        if self._following:
            self._metrics.grant_waits.inc()
            waiter = self._waiters.get(lease_id)
            if waiter is None:
                waiter = self._waiters[lease_id] = asyncio.get_running_loop().create_future()
            try:
                if await asyncio.wait_for(asyncio.shield(waiter), self._wait_s):
                    return True
            except TimeoutError:
                if self._waiters.get(lease_id) is waiter:
                    del self._waiters[lease_id]
        self._metrics.grant_copies.inc()
        get_logger().warning("grant_not_seen_stored", lease_id=lease_id, following=self._following)
        return False

    async def _on_grant(self, msg: Msg) -> None:
        msg_id = (msg.headers or {}).get(MSG_ID_HEADER, "")
        if msg_id.endswith(_GRANTED_SUFFIX):
            self.saw(msg_id[: -len(_GRANTED_SUFFIX)])

    async def run(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        """Follow the grants JetStream stores, from ``keep_s`` back, until ``stop``."""
        since = datetime.now(UTC) - timedelta(seconds=self._keep_s)
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=since,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
        )
        subscription = await js.subscribe(
            subjects.ALLOC_GRANTED.address,
            stream=subjects.EVENTS_STREAM.name,
            cb=self._on_grant,
            ordered_consumer=True,
            config=config,
        )
        # nats-py re-creates an ordered consumer (after a gap, or NATS restarting) from this
        # same config, by start sequence, and leaves the start time in it, which the server
        # refuses ("deliver by start sequence, but optional start time is also set"; nats.go
        # fixed the same in #1341): the watch would stay dead. The time served its turn.
        config.opt_start_time = None
        self._following = True
        try:
            await stop.wait()
        finally:
            get_logger().info("grant_watch_stopped", waits=self.waits, copies=self.copies)
            self._following = False
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_result(False)
            self._waiters.clear()
            with suppress(Exception):  # the connection may be gone already
                await subscription.unsubscribe()
