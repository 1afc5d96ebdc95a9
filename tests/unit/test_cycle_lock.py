"""The scheduler's cycle lock gives itself back without failing its caller when the ledger is
away: the soak (``bench/soak/soak.py``) found a scheduler that exited because Redis, restarted,
answered "loading" to the give-back after an idle linger, outside the cycle's error handling."""

from __future__ import annotations

from redis.asyncio import Redis

from xpupool.devstack.servers import free_ports
from xpupool.ledger import Ledger
from xpupool.scheduler.main import CycleLock


async def test_giving_the_lock_back_with_the_ledger_away_does_not_raise() -> None:
    (port,) = free_ports(1)  # nothing listens there
    redis = Redis(port=port, socket_connect_timeout=0.5)
    try:
        lock = CycleLock(Ledger(redis, "xpupool"), "scheduler-test")
        await lock.give_back()
        assert not lock.held
    finally:
        await redis.aclose()
