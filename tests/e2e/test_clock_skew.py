"""The reliability plan's F13: the scheduler, the lease-manager and the node's collector run
with their clocks ten minutes ahead or behind (libfaketime, the wall clock only; their monotonic
clocks run true, as on a host whose NTP is off). Every term is the ledger's: a grant's times come
from Redis's clock, a lease lives its term (not ten minutes less or more), a renewal keeps it,
one that is not renewed expires within the sweep's bound, and a request waits its
``max_wait_s``.

Needs libfaketime (Debian's ``faketime``; ``.ci/run`` installs it); skipped, saying so, without.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready
from xpupool.contracts import (
    AllocationGranted,
    EndReason,
    GangSpec,
    JobRequested,
    JobTimedOut,
    LeaseEnded,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LIBFAKETIME = next(
    (
        path
        for path in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"),
            Path("/usr/lib/faketime/libfaketime.so.1"),
        )
        if path.exists()
    ),
    None,
)
# The lease-manager's sweep looks for expired leases about once a second; a lease not renewed
# ends within its term plus this.
EXPIRY_BOUND_S = 3.0


def _skewed(offset: str) -> dict[str, str]:
    assert LIBFAKETIME is not None
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        # asyncio's timers and every timeout run on the monotonic clock: left true.
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.mark.skipif(LIBFAKETIME is None, reason="libfaketime is not installed (apt: faketime)")
@pytest.mark.parametrize("offset", ["+600s", "-600s"])
async def test_services_with_a_skewed_clock_keep_every_term_by_the_ledgers_clock(
    make_stack: Callable[..., Stack], ready: Ready, offset: str
) -> None:
    stack = make_stack([NodeSpec("node-skew", "2xA100-80GB")])
    ledger = await ready(stack, 2)
    for service in list(stack.services):  # the collector too: its samples' times are skewed
        stack.restart(service, **_skewed(offset))
    await stack.wait_until_pulling()
    log = EventLog()
    async with stack.client("t") as client:
        await log.attach(client.nc)
        # The services' clocks are skewed; the lease-manager's answer is not (Redis's).
        lone = await client.submit_and_wait(
            JobRequested(job_id="unrenewed", tenant="t", lease_ttl_s=2), timeout_s=30
        )
        granted_real = time.monotonic()
        assert isinstance(lone, AllocationGranted)
        assert abs((lone.granted_at - datetime.now(UTC)).total_seconds()) < 5
        assert abs((lone.expires_at - lone.granted_at).total_seconds() - 2) < 0.5

        kept = await client.submit_and_wait(
            JobRequested(job_id="renewed", tenant="t", lease_ttl_s=2), timeout_s=30
        )
        assert isinstance(kept, AllocationGranted)
        # A gang of both devices waits (one is held throughout) and times out on its own term.
        waiting_since = time.monotonic()
        gang = asyncio.create_task(
            client.submit_and_wait(
                JobRequested(job_id="waits", tenant="t", count=2, gang=GangSpec(), max_wait_s=2),
                timeout_s=30,
            )
        )
        for _ in range(10):  # 5 s of renewals, past two and a half terms
            await asyncio.sleep(0.5)
            reply = await client.renew(kept.lease_id, kept.fencing_token)
            assert reply.ok, reply
        timed_out = await gang
        assert isinstance(timed_out, JobTimedOut)
        assert 2 <= time.monotonic() - waiting_since < 2 + EXPIRY_BOUND_S + 5

        def ended(lease_id: str) -> LeaseEnded | None:
            return next((e for e in log.distinct(LeaseEnded) if e.lease_id == lease_id), None)

        await eventually(lambda: ended(lone.lease_id) is not None, timeout_s=10)
        end = ended(lone.lease_id)
        assert end is not None and end.reason == EndReason.EXPIRED
        assert abs((end.ended_at - datetime.now(UTC)).total_seconds()) < 10
        # Not before its term by the real clock, and not long after.
        lived = (end.ended_at - lone.granted_at).total_seconds()
        assert 2 <= lived < 2 + EXPIRY_BOUND_S, lived
        assert time.monotonic() - granted_real >= 2
        assert ended(kept.lease_id) is None  # renewed: still live after 5 s
        reply = await client.release(kept.lease_id, kept.fencing_token)
        assert reply.ok, reply
    assert await audit(ledger) == []
