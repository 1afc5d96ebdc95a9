"""Lease lifecycle edges on a real redis-server (and nats-server for the client): a sweep
that fails does not keep leases alive past their term, a preemption's grace is kept by a lease
already warned of another end, and a client never turns a bad renewal term into the default."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.exceptions import NoPermissionError

from tests.conftest import eventually
from tests.integration.ledger_builders import device_spec, granted_whole_leases, reservation
from xpupool.bus import DispatchStats
from xpupool.bus.connection import round_trip
from xpupool.bus.lifecycle import open_bus
from xpupool.client import XpupoolClient
from xpupool.contracts import EndLease, EndReason, LeaseReply, RenewLease, encode
from xpupool.contracts import subjects as s
from xpupool.devstack.servers import NatsServer, RedisServer
from xpupool.lease_manager.main import expire_leases, scheduler_commands
from xpupool.ledger import Ledger, SliceClaim, audit

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _ended(ledger: Ledger, lease_id: str) -> str | None:
    """The lease's end reason once it ended, else None."""
    lease = await ledger.get_lease(lease_id)
    return lease.end_reason if lease is not None and lease.state == "ended" else None


# ---- the expiry sweep ---------------------------------------------------------------------------


async def _sweeping(ledger: Ledger, until: asyncio.Event) -> asyncio.Task[None]:
    """The lease-manager's expiry loop on ``ledger``, a tick every 50 ms, until ``until``."""
    return asyncio.create_task(
        expire_leases(ledger, interval_s=0.05, warning_s=60, idle_warning_s=60, stop=until)
    )


async def test_a_refused_warning_sweep_does_not_keep_leases_past_their_term(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle reclaim and the maximum run time's warnings are refused at every tick (a role whose
    ACL predates their scripts): a lease whose term passed still ends, on time."""

    async def refused(warning_ms: int, limit: int = 0) -> None:
        raise NoPermissionError("this user has no permissions to run the 'evalsha' command")

    monkeypatch.setattr(ledger, "reclaim_idle", refused)
    monkeypatch.setattr(ledger, "warn_deadlines", refused)
    [lease_id] = await granted_whole_leases(ledger, 1, ttl_ms=200)
    stop = asyncio.Event()
    sweeping = await _sweeping(ledger, stop)
    try:
        assert await eventually(lambda: _ended(ledger, lease_id), timeout_s=3) == "expired"
    finally:
        stop.set()
        await asyncio.wait_for(sweeping, 5)


async def test_a_watched_lease_without_slices_neither_stops_the_sweep_nor_lives_on(
    ledger: Ledger,
) -> None:
    """A lease of an idle-reclaim queue whose record lost its slices (damaged by hand or by an
    older writer) is reclaimed like any other, and the sweep goes on to end every other lease
    whose term passed."""
    await ledger.register_node("n1", [device_spec("n1", 0), device_spec("n1", 1)])
    terms: tuple[tuple[str, int, dict[str, int]], ...] = (
        ("watched", 0, {"idle_after_ms": 100}),
        ("short", 1, {"ttl_ms": 200}),
    )
    for job, device, term in terms:
        claim = SliceClaim(device_id=f"n1/nvidia{device}", whole=True)
        assert (await ledger.reserve(reservation(job, claim, **term))).ok
        assert (await ledger.grant(f"lease-{job}")).ok
    watched, short = "lease-watched", "lease-short"
    await ledger.redis.hdel(ledger.key("lease", watched), "slices")
    await asyncio.sleep(0.15)
    assert (await ledger.reclaim_idle(warning_ms=0)).ended == [watched]
    stop = asyncio.Event()
    sweeping = await _sweeping(ledger, stop)
    try:
        assert await eventually(lambda: _ended(ledger, short), timeout_s=3) == "expired"
        assert await eventually(lambda: _ended(ledger, watched), timeout_s=3) == "idle"
    finally:
        stop.set()
        await asyncio.wait_for(sweeping, 5)


# ---- the scheduler's commands ------------------------------------------------------------------


async def test_a_lease_end_sent_while_the_ledger_restarts_ends_the_lease_once_it_is_back(
    nats_server: NatsServer, redis_server: RedisServer, ledger: Ledger
) -> None:
    """The scheduler's EndLease (a cancel: its lease is marked, and the command queued once)
    arrives while Redis is down for longer than the bus's default redelivery (5 tries, about
    6 s): the lease-manager keeps it, and ends the lease once Redis is back."""
    [lease_id] = await granted_whole_leases(ledger, 1, ttl_ms=120_000)
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_server.url, "lease-manager")
        consuming = [
            asyncio.create_task(command)
            for command in scheduler_commands(bus, ledger, stop, DispatchStats())
        ]
        try:
            redis_server.kill()
            end = EndLease(lease_id=lease_id, reason=EndReason.RELEASED, detail="cancelled")
            await bus.publisher.publish(end)
            await asyncio.sleep(8)  # past the default's last try
            redis_server.start()
            assert await eventually(lambda: _ended(ledger, lease_id), timeout_s=10) == "released"
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*consuming), 10)
    assert await audit(ledger) == []


# ---- a preemption's grace -----------------------------------------------------------------------


@pytest.mark.parametrize("first", ["max_runtime", "idle"])
async def test_a_preemption_s_grace_holds_for_a_lease_already_warned_of_a_later_end(
    ledger: Ledger, first: str
) -> None:
    """A lease warned that it ends in a minute (its maximum run time, or idle) is preempted with
    a grace of 200 ms: it ends ``preempted`` at that grace, as its holder is told, not at the
    later end; a second preemption changes nothing."""
    [lease_id] = await granted_whole_leases(
        ledger, 1, max_runtime_ms=60_000 if first == "max_runtime" else 0, idle_after_ms=1
    )
    await asyncio.sleep(0.01)
    if first == "max_runtime":
        assert (await ledger.warn_deadlines(warning_ms=120_000)).ended == [lease_id]
    else:
        assert (await ledger.reclaim_idle(warning_ms=60_000)).ended == [lease_id]
    assert (await ledger.end_after(lease_id, "preempted", 200)).ok
    again = await ledger.end_after(lease_id, "preempted", 200)
    assert again.ok and again.duplicate
    lease = await ledger.get_lease(lease_id)
    assert lease is not None and lease.deadline_ms is not None
    assert lease.deadline_ms - await ledger.now_ms() <= 200
    entries: Any = await ledger.redis.xrange(ledger.key("outbox", "lease-manager"))
    warnings = [f[b"reason"].decode() for _, f in entries if f[b"kind"] == b"ending"]
    assert warnings == [first, "preempted"]
    await asyncio.sleep(0.25)
    assert (await ledger.expire_due()).ended == [lease_id]
    assert await _ended(ledger, lease_id) == "preempted"
    assert await audit(ledger) == []


async def test_a_preemption_with_a_later_grace_leaves_a_sooner_end_as_it_is(
    ledger: Ledger,
) -> None:
    """A lease that ends within 200 ms (its maximum run time, warned) keeps that end and its
    reason when a preemption grants it a minute: nothing is queued for the holder."""
    [lease_id] = await granted_whole_leases(ledger, 1, max_runtime_ms=200)
    assert (await ledger.warn_deadlines(warning_ms=60_000)).ended == [lease_id]
    before = await ledger.get_lease(lease_id)
    result = await ledger.end_after(lease_id, "preempted", 60_000)
    assert result.ok and result.duplicate
    assert await ledger.get_lease(lease_id) == before
    await asyncio.sleep(0.25)
    assert (await ledger.expire_due()).ended == [lease_id]
    assert await _ended(ledger, lease_id) == "max_runtime"


# ---- the client's renewal term ------------------------------------------------------------------


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


@pytest.mark.parametrize("ttl_s", [math.nan, math.inf, -math.inf])
async def test_a_renewal_term_that_is_no_number_is_refused_not_sent_as_the_default(
    nats_server: NatsServer, service: Client, ttl_s: float
) -> None:
    """JSON has no NaN or infinity: encoded, such a term would read as no term at all, and the
    lease-manager would renew for the lease's own term and answer ``ok``. The client refuses it,
    naming ``ttl_s``, and sends nothing."""
    received: list[RenewLease] = []

    async def on_renew(msg: Msg) -> None:
        received.append(msgspec.json.decode(msg.data, type=RenewLease))
        await msg.respond(encode(LeaseReply(ok=True, lease_id="lease-1")))

    await service.subscribe(s.LEASE_RENEW.subject(tenant="acme"), cb=on_renew)
    await round_trip(service)  # the server has the subscription
    nc = await nats.connect(nats_server.url)
    try:
        client = XpupoolClient(nc, "acme", request_timeout_s=2)
        with pytest.raises(ValueError, match="ttl_s"):
            await client.renew("lease-1", 1, ttl_s, secret="s")
        # A finite term still goes out as given.
        assert (await client.renew("lease-1", 1, 30.0, secret="s")).ok
    finally:
        await nc.close()
    assert [r.ttl_s for r in received] == [30.0]
