"""A supervised run that loses a cancellation still ends when the service stops."""

from __future__ import annotations

import asyncio

import pytest

from xpupool.bus.lifecycle import supervise


@pytest.mark.timeout(10)
async def test_a_run_that_swallows_its_cancellation_is_cancelled_again() -> None:
    """As a first connect does when its cancellation lands inside Python 3.11's wait_for: the
    run swallows one CancelledError and carries on; stopping must still end it within
    about a second, not wait for it forever."""
    swallowed = 0

    async def connecting_forever(run_stop: asyncio.Event) -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    stop = asyncio.Event()
    supervisor = asyncio.create_task(supervise(connecting_forever, stop))
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(supervisor, timeout=3)
    assert swallowed == 2
