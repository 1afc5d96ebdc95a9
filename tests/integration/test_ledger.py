"""The ledger's Lua transitions against a real redis-server: each rule, and what breaks it."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceSample, Health, PartitionSpec
from xpupool.ledger import (
    AdmissionLimits,
    Holder,
    HostClaim,
    LeaseRecord,
    Ledger,
    SliceClaim,
    SliceMeta,
    UsageClaim,
    audit,
)

pytestmark = pytest.mark.integration


async def _two_gpus(ledger: Ledger) -> None:
    result = await ledger.register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000
    )
    assert result.ok and len(result.added) == 2


async def test_whole_device_excludes_shares_and_vice_versa(ledger: Ledger) -> None:
    """A whole device takes no share, and a shared device cannot be taken whole."""
    await _two_gpus(ledger)
    assert (await ledger.reserve(reservation("w", SliceClaim("n1/nvidia0", whole=True)))).ok
    refused = await ledger.reserve(reservation("s", SliceClaim("n1/nvidia0", 1024, 10)))
    assert not refused.ok and refused.reason == "insufficient_capacity"
    assert (await ledger.reserve(reservation("s2", SliceClaim("n1/nvidia1", 1024, 10)))).ok
    refused = await ledger.reserve(reservation("w2", SliceClaim("n1/nvidia1", whole=True)))
    assert not refused.ok
    assert await audit(ledger) == []


async def test_reservations_sent_together_are_each_atomic_and_in_order(ledger: Ledger) -> None:
    """reserve_many: one round trip, each script still checks on its own, in order: the second
    claim on a device is refused, the one after it still goes through."""
    await _two_gpus(ledger)
    results = await ledger.reserve_many(
        [
            reservation("a", SliceClaim("n1/nvidia0", whole=True)),
            reservation("b", SliceClaim("n1/nvidia0", whole=True)),
            reservation("c", SliceClaim("n1/nvidia1", 1024, 10)),
        ]
    )
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].reason == "insufficient_capacity"
    assert await ledger.reserve_many([]) == []
    assert await audit(ledger) == []


async def test_memory_only_share_round_trips_without_partial_writes(ledger: Ledger) -> None:
    """A share with no compute (0 %) reserves and releases cleanly (regression: Lua's -0)."""
    await _two_gpus(ledger)
    for i in range(5):
        job = f"mem-{i}"
        assert (await ledger.reserve(reservation(job, SliceClaim("n1/nvidia0", 4096, 0)))).ok
        assert (await ledger.end(f"lease-{job}", "released")).ok
    assert await audit(ledger) == []
    device = (await ledger.nodes())[0].devices[0]
    assert device.memory_free_mib == device.memory_total_mib and device.holders == 0


async def test_refused_reservation_writes_nothing(ledger: Ledger) -> None:
    """A reservation that fails any check (here the second device) leaves no trace at all."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("first", SliceClaim("n1/nvidia1", whole=True)))
    before = [(d.memory_free_mib, d.holders) for d in (await ledger.nodes())[0].devices]
    refused = await ledger.reserve(
        reservation(
            "gang",
            SliceClaim("n1/nvidia0", whole=True),
            SliceClaim("n1/nvidia1", whole=True),
            host={"n1": HostClaim(1000, 1000)},
        )
    )
    assert not refused.ok
    after = [(d.memory_free_mib, d.holders) for d in (await ledger.nodes())[0].devices]
    assert before == after and (await ledger.nodes())[0].cpu_free_milli == 64_000
    assert await ledger.get_job("gang") is None


async def test_racing_reservations_for_the_last_slice_have_one_winner(ledger: Ledger) -> None:
    """Fifty concurrent reservations for one device: exactly one wins."""
    await ledger.register_node("n1", [device_spec("n1", 0)])
    results = await asyncio.gather(
        *(
            ledger.reserve(reservation(f"r{i}", SliceClaim("n1/nvidia0", whole=True)))
            for i in range(50)
        )
    )
    assert sum(r.ok for r in results) == 1
    assert await audit(ledger) == []


async def test_quota_limit_is_checked_in_the_same_step(ledger: Ledger) -> None:
    """Usage counters never pass their limit, and ending a lease gives the units back."""
    await _two_gpus(ledger)
    claim = [UsageClaim("q", "units", 1.0, 1.0)]
    assert (
        await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", whole=True), usage=claim))
    ).ok
    refused = await ledger.reserve(
        reservation("b", SliceClaim("n1/nvidia1", whole=True), usage=claim)
    )
    assert not refused.ok and refused.reason == "quota_exceeded"
    await ledger.end("lease-a", "released")
    assert (await ledger.usage("q"))["units"] == pytest.approx(0.0)
    assert (
        await ledger.reserve(reservation("b", SliceClaim("n1/nvidia1", whole=True), usage=claim))
    ).ok


async def test_fencing_tokens_guard_renew_and_release(ledger: Ledger) -> None:
    """Tokens grow with every grant; a stale token can neither renew nor release."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", whole=True)))
    await ledger.reserve(reservation("b", SliceClaim("n1/nvidia1", whole=True)))
    first, second = await ledger.grant("lease-a", "s3cret"), await ledger.grant("lease-b")
    assert second.token > first.token
    assert (await ledger.grant("lease-a", "other")).duplicate  # idempotent, first secret kept
    holder = Holder("t", "s3cret", first.token)
    stale = Holder("t", "s3cret", first.token + 1)
    assert (await ledger.renew("lease-a", stale)).reason == "stale_token"
    assert (await ledger.release("lease-a", stale)).reason == "stale_token"
    assert (await ledger.renew("lease-a", holder, 120_000)).ok
    assert (await ledger.release("lease-a", holder)).ok
    assert (await ledger.release("lease-a", holder)).reason == "lease_ended"


async def test_concurrent_holder_commands_are_batched_and_answered_each(ledger: Ledger) -> None:
    """Renewals and releases made together go out in one pipelined batch per script; each still
    gets its own answer (a good release, a refused one, a repeated one, a renewal), in order."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", 1024, 10)))
    await ledger.reserve(reservation("b", SliceClaim("n1/nvidia1", 1024, 10)))
    a, b = await ledger.grant("lease-a", "sa"), await ledger.grant("lease-b", "sb")
    holder_a, holder_b = Holder("t", "sa", a.token), Holder("t", "sb", b.token)
    results = await asyncio.gather(
        ledger.release("lease-a", holder_a),
        ledger.release("lease-b", Holder("t", "wrong", b.token)),
        ledger.release("lease-a", holder_a),
        ledger.renew("lease-b", holder_b, 120_000),
        ledger.renew("lease-b", Holder("t", "sb", b.token + 1)),
    )
    assert [r.ok or r.reason for r in results] == [
        True,
        "bad_secret",
        "lease_ended",
        True,
        "stale_token",
    ]
    lease_b = await ledger.get_lease("lease-b")
    assert lease_b is not None and lease_b.state == "active"
    assert await audit(ledger) == []


async def test_only_the_owner_with_the_secret_can_touch_a_lease(ledger: Ledger) -> None:
    """Another tenant, a wrong secret, an ended lease and an unknown lease are each refused with
    their own reason, and none of them changes the lease or the ledger."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", whole=True)))
    assert (
        await ledger.renew("lease-a", Holder("t", "", 0))
    ).reason == "bad_secret"  # reserved, never granted: no secret yet
    granted = await ledger.grant("lease-a", "right")
    before = await ledger.get_lease("lease-a")
    version = await ledger.version()
    refusals = {
        "not_owner": Holder("intruder", "right", granted.token),
        "bad_secret": Holder("t", "wrong", granted.token),
        "stale_token": Holder("t", "right", granted.token - 1),
    }
    for reason, holder in refusals.items():
        assert (await ledger.renew("lease-a", holder, 1_000)).reason == reason
        assert (await ledger.release("lease-a", holder)).reason == reason
    assert (await ledger.renew("lease-b", Holder("t", "x", 1))).reason == "unknown_lease"
    assert await ledger.get_lease("lease-a") == before
    assert await ledger.version() == version
    assert await audit(ledger) == []
    await ledger.end("lease-a", "preempted")
    owner = Holder("t", "right", granted.token)
    assert (await ledger.release("lease-a", owner)).reason == "lease_ended"
    assert (await ledger.renew("lease-a", owner)).reason == "lease_ended"
    # Another tenant learns nothing about the state of a lease it does not own.
    assert (await ledger.release("lease-a", Holder("x", "right", 0))).reason == "not_owner"


async def test_admission_limits_per_tenant(ledger: Ledger) -> None:
    """A tenant over its burst is rate limited and one at its pending maximum is refused, while
    another tenant is admitted; a job leaving the queue gives its pending slot back."""
    burst = AdmissionLimits(rate_per_s=1.0, burst=3, max_pending=-1)
    results = [
        await ledger.pend(f"r{i}", 1, b"{}", None, "queued", tenant="a", limits=burst)
        for i in range(5)
    ]
    assert [r.ok for r in results] == [True, True, True, False, False]
    assert results[3].reason == "rate_limited"
    other = await ledger.pend("b0", 1, b"{}", None, "queued", tenant="b", limits=burst)
    assert other.ok
    capped = AdmissionLimits(max_pending=3)
    refused = await ledger.pend("r9", 1, b"{}", None, "queued", tenant="a", limits=capped)
    assert not refused.ok and refused.reason == "too_many_pending"
    assert await ledger.pending_count("a") == 3
    await ledger.drop_pending("r0", "invalid_request", "", "")
    assert await ledger.pending_count("a") == 2
    assert (await ledger.pend("r9", 1, b"{}", None, "queued", tenant="a", limits=capped)).ok
    # A duplicate of a waiting job is not a new request: no slot, no token taken.
    assert (await ledger.pend("r9", 1, b"{}", None, "queued", tenant="a", limits=capped)).duplicate
    assert await ledger.pending_count("a") == 3


async def test_expiry_uses_the_ledger_clock_and_ends_once(ledger: Ledger) -> None:
    """A lease past its term ends as expired exactly once and frees its device."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("x", SliceClaim("n1/nvidia0", whole=True), ttl_ms=200))
    await ledger.grant("lease-x")
    assert (await ledger.expire_due()).ended == []
    await asyncio.sleep(0.3)
    assert (await ledger.expire_due()).ended == ["lease-x"]
    assert (await ledger.expire_due()).ended == []
    lease = await ledger.get_lease("lease-x")
    assert lease is not None and lease.end_reason == "expired"
    assert (await ledger.nodes())[0].devices[0].holders == 0


async def test_reregistration_reconciles_devices_and_ends_leases_on_vanished_ones(
    ledger: Ledger,
) -> None:
    """A restarted collector with a changed device set: usage of survivors is kept, a new
    device joins free, leases on a vanished device end as lost; duplicate ids are refused."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("keep", SliceClaim("n1/nvidia0", 8192, 50)))
    await ledger.reserve(reservation("gone", SliceClaim("n1/nvidia1", whole=True)))
    result = await ledger.register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 2)], 64_000, 256_000
    )
    assert result.added == ["n1/nvidia2"] and result.removed == ["n1/nvidia1"]
    assert result.lost == ["lease-gone"]
    devices = {d.spec.device_id: d for d in (await ledger.nodes())[0].devices}
    assert devices["n1/nvidia0"].memory_free_mib == 81920 - 8192
    assert devices["n1/nvidia2"].holders == 0
    duplicate = await ledger.register_node("n1", [device_spec("n1", 0), device_spec("n1", 0)])
    assert not duplicate.ok and duplicate.reason == "duplicate_device_id"
    assert await audit(ledger) == []


async def test_unhealthy_device_takes_no_new_grant(ledger: Ledger) -> None:
    """The reserve script refuses a device that is not healthy, whatever the caller believed."""
    await _two_gpus(ledger)
    assert (await ledger.set_health("n1/nvidia0", Health.UNHEALTHY, "xid 79")).previous == "healthy"
    refused = await ledger.reserve(reservation("u", SliceClaim("n1/nvidia0", 1024, 10)))
    assert not refused.ok and refused.reason == "device_unhealthy"


async def test_silent_node_is_declared_lost_with_its_leases(ledger: Ledger) -> None:
    """A node past its heartbeat grace is lost; its leases end as lost, its devices are lost."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("on-n1", SliceClaim("n1/nvidia0", whole=True)))
    await asyncio.sleep(0.2)
    assert (await ledger.reap_nodes(100)).lost == ["n1"]
    lease = await ledger.get_lease("lease-on-n1")
    assert lease is not None and lease.end_reason == "lost"
    assert not (await ledger.heartbeat("n1")).ok  # it must register again
    assert all(d.health is Health.LOST for d in (await ledger.nodes())[0].devices)


async def test_a_lost_leases_device_is_quarantined_until_its_holder_has_surely_stopped(
    ledger: Ledger,
) -> None:
    """A node lost under a lease (cut off, not crashed: its holder may run on) and back before
    the lease's term ends brings that lease's device up unhealthy, quarantined until the term
    plus the holder's grace, and no grant lands there meanwhile; its collector's readings in
    between are kept for then. The node's other device, which held nothing, is grantable at
    once. The reap after the quarantine ran out lifts it."""
    devices = [device_spec("n1", 0), device_spec("n1", 1)]
    assert (await ledger.register_node("n1", devices, instance="collector-1")).ok
    held = reservation("held", SliceClaim("n1/nvidia0", whole=True), ttl_ms=1_500)
    assert (await ledger.reserve(held)).ok
    assert (await ledger.grant("lease-held")).ok
    lease = await ledger.get_lease("lease-held")
    assert lease is not None
    await asyncio.sleep(0.2)
    assert (await ledger.reap_nodes(100, holder_grace_ms=500)).lost == ["n1"]

    # The same collector process back: the node was cut off, not restarted.
    assert (await ledger.register_node("n1", devices, instance="collector-1")).ok
    health = {d.spec.device_id: d.health for d in (await ledger.nodes())[0].devices}
    assert health == {"n1/nvidia0": Health.UNHEALTHY, "n1/nvidia1": Health.HEALTHY}
    refused = await ledger.reserve(reservation("next", SliceClaim("n1/nvidia0", whole=True)))
    assert not refused.ok and refused.reason == "device_unhealthy"
    assert (await ledger.reserve(reservation("other", SliceClaim("n1/nvidia1", whole=True)))).ok
    # The collector's readings while quarantined: no transition now, the last one kept.
    assert (await ledger.set_health("n1/nvidia0", Health.DEGRADED, "ecc")).previous == "degraded"
    assert (await ledger.set_health("n1/nvidia0", Health.HEALTHY, "")).previous == "healthy"
    reason = await ledger.redis.hget(ledger.key("dev", "n1/nvidia0"), "health_reason")
    assert isinstance(reason, bytes)
    assert b"quarantined" in reason and b"lease-held" in reason

    assert (await ledger.reap_nodes(60_000, holder_grace_ms=500)).lost == []
    assert (await ledger.nodes())[0].devices[0].health is Health.UNHEALTHY  # not over yet
    now_ms = await ledger.now_ms()
    await asyncio.sleep((lease.expires_ms + 500 - now_ms) / 1000 + 0.05)
    assert (await ledger.reap_nodes(60_000, holder_grace_ms=500)).lost == []
    assert (await ledger.nodes())[0].devices[0].health is Health.HEALTHY
    assert (await ledger.reserve(reservation("next", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert await ledger.redis.zcard(ledger.key("quarantine")) == 0
    assert await audit(ledger) == []


@pytest.mark.parametrize("term_ms", [300, 60_000])
async def test_a_restarted_collector_or_a_lease_past_its_term_quarantines_nothing(
    ledger: Ledger, term_ms: int
) -> None:
    """A node back after its lost lease's term (and the holder's grace) ran out, or registered
    by another collector process (a restart over a network that was up: the holder heard its
    lease end): its devices are healthy again at once."""
    devices = [device_spec("n1", 0), device_spec("n1", 1)]
    assert (await ledger.register_node("n1", devices, instance="collector-1")).ok
    held = reservation("held", SliceClaim("n1/nvidia0", whole=True), ttl_ms=term_ms)
    assert (await ledger.reserve(held)).ok
    assert (await ledger.grant("lease-held")).ok
    await asyncio.sleep(0.5)
    assert (await ledger.reap_nodes(100, holder_grace_ms=100)).lost == ["n1"]
    instance = "collector-1" if term_ms < 1000 else "collector-2"
    assert (await ledger.register_node("n1", devices, instance=instance)).ok
    assert all(d.health is Health.HEALTHY for d in (await ledger.nodes())[0].devices)
    assert (await ledger.reserve(reservation("next", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert await audit(ledger) == []


async def test_a_heartbeat_writes_its_ticks_load_in_the_same_script(ledger: Ledger) -> None:
    """A collector's tick is one script: the heartbeat stamps the node and writes the load it
    sampled (the changed utilisation logged for readers), in one ``EVALSHA`` and so one fsync
    of the AOF. A node that must register again gets its samples refused with its heartbeat:
    nothing is written to the devices of a lost node."""
    await _two_gpus(ledger)
    assert (await ledger.heartbeat("n1")).ok  # the script is in Redis's cache from here on
    cursor = (await ledger.changes_since(None)).cursor
    [before] = await ledger.nodes()
    calls = (await ledger.redis.info("commandstats"))["cmdstat_evalsha"]["calls"]
    await asyncio.sleep(0.01)
    tick = [
        DeviceSample(device_id="n1/nvidia0", util_pct=42.0, memory_used_mib=1000),
        DeviceSample(device_id="n1/nvidia1", util_pct=None, memory_used_mib=None),
    ]
    assert (await ledger.heartbeat("n1", tick)).ok
    assert (await ledger.redis.info("commandstats"))["cmdstat_evalsha"]["calls"] == calls + 1
    [after] = await ledger.nodes()
    assert after.last_seen_ms > before.last_seen_ms
    assert (after.devices[0].util_pct, after.devices[0].memory_used_mib) == (42.0, 1000)
    assert (after.devices[1].util_pct, after.devices[1].memory_used_mib) == (None, None)
    changes = await ledger.changes_since(cursor, max_records=256)
    assert changes.records is not None and "n1" in changes.records.nodes

    # What a sample writes: the values and their integrals, and when the device last worked;
    # a device whose sample read nothing and that never read anything keeps no load at all.
    sampled = await ledger.redis.hgetall(ledger.key("dev", "n1/nvidia0"))
    assert (sampled[b"util"], sampled[b"mem_used"]) == (b"42.0", b"1000")
    assert {b"util_int", b"mem_int", b"load_ms", b"active_ms"} <= set(sampled)
    unread = await ledger.redis.hgetall(ledger.key("dev", "n1/nvidia1"))
    assert {b"util", b"mem_used", b"util_int", b"mem_int", b"active_ms"} & set(unread) == set()

    await asyncio.sleep(0.2)
    assert (await ledger.reap_nodes(100)).lost == ["n1"]
    refused = await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=99.0)])
    assert not refused.ok and refused.reason == "node_lost"
    assert await ledger.redis.hget(ledger.key("dev", "n1/nvidia0"), "util") == b"42.0"
    unknown = await ledger.heartbeat("n9", [DeviceSample(device_id="n9/nvidia0", util_pct=5.0)])
    assert not unknown.ok and unknown.reason == "unknown_node"
    assert not await ledger.redis.exists(ledger.key("dev", "n9/nvidia0"))


async def test_a_heartbeat_writes_the_load_of_its_own_registered_devices_only(
    ledger: Ledger,
) -> None:
    """A tick's sample of a device the ledger does not hold for that node (one the collector
    sees before it registers it again, or another node's) is not written: no hash with load and
    no spec is left behind, and no node moves another's load. The node's own devices are
    written as ever, and a device sampled ahead of its registration joins free."""
    await _two_gpus(ledger)
    assert (await ledger.register_node("n2", [device_spec("n2", 0)], 64_000, 256_000)).ok
    tick = [
        DeviceSample(device_id="n1/nvidia0", util_pct=30.0, memory_used_mib=500),
        DeviceSample(device_id="n1/nvidia7", util_pct=50.0, memory_used_mib=700),
        DeviceSample(device_id="n2/nvidia0", util_pct=90.0, memory_used_mib=900),
    ]
    assert (await ledger.heartbeat("n1", tick)).ok
    assert not await ledger.redis.exists(ledger.key("dev", "n1/nvidia7"))
    theirs = await ledger.redis.hgetall(ledger.key("dev", "n2/nvidia0"))
    assert {b"util", b"mem_used", b"util_int", b"active_ms"} & set(theirs) == set()
    nodes = {n.node_id: n for n in await ledger.nodes()}
    assert (nodes["n1"].devices[0].util_pct, nodes["n1"].devices[0].memory_used_mib) == (30.0, 500)
    assert nodes["n2"].devices[0].util_pct is None

    specs = [device_spec("n1", 0), device_spec("n1", 1), device_spec("n1", 7)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).added == ["n1/nvidia7"]
    assert (await ledger.heartbeat("n1", tick[1:2])).ok
    [n1] = [n for n in await ledger.nodes() if n.node_id == "n1"]
    [joined] = [d for d in n1.devices if d.spec.device_id == "n1/nvidia7"]
    assert (joined.util_pct, joined.memory_used_mib) == (50.0, 700)
    assert await audit(ledger) == []


async def test_an_idle_devices_tick_writes_nothing_and_its_integrals_hold(
    ledger: Ledger,
) -> None:
    """A device idle before and after a sample (no utilisation, no memory) adds nothing to its
    load integrals however long it stays so: the tick writes nothing to it, only the node's
    heartbeat. Load that moves is written and integrated as before, from the idle stretch on."""
    await _two_gpus(ledger)
    dev = ledger.key("dev", "n1/nvidia0")

    def tick(util: float | None, mem: int | None) -> list[DeviceSample]:
        return [DeviceSample(device_id="n1/nvidia0", util_pct=util, memory_used_mib=mem)]

    assert (await ledger.heartbeat("n1", tick(0.0, 0))).ok  # the first sample is written
    stored = await ledger.redis.hgetall(dev)
    hsets = (await ledger.redis.info("commandstats"))["cmdstat_hset"]["calls"]
    for sample in (tick(0.0, 0), tick(None, None), tick(0.0, None)):
        await asyncio.sleep(0.05)
        assert (await ledger.heartbeat("n1", sample)).ok
    # Three ticks, one HSET each: the node's last-seen time; the device untouched.
    assert (await ledger.redis.info("commandstats"))["cmdstat_hset"]["calls"] == hsets + 3
    assert await ledger.redis.hgetall(dev) == stored

    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("n1", tick(50.0, 1000))).ok  # the idle stretch adds nothing
    first = await ledger.redis.hmget(dev, "util_int", "mem_int", "load_ms", "util", "mem_used")
    util_int, mem_int, since_ms = (float(v or "nan") for v in first[:3])
    assert (util_int, mem_int) == (0.0, 0.0) and first[3:] == [b"50.0", b"1000"]
    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("n1", tick(0.0, 0))).ok  # 50 % and 1000 MiB held until now
    second = await ledger.redis.hmget(dev, "util_int", "mem_int", "load_ms")
    util_int, mem_int, until_ms = (float(v or "nan") for v in second)
    held_s = (until_ms - since_ms) / 1000
    assert held_s >= 0.2
    assert util_int == pytest.approx(50.0 * held_s)
    assert mem_int == pytest.approx(1000 * held_s)
    assert (await ledger.heartbeat("n1", tick(0.0, 0))).ok  # idle again: nothing written
    assert await ledger.redis.hmget(dev, "util_int", "mem_int", "load_ms") == second


async def test_reaping_looks_at_overdue_nodes_only_and_indexes_an_older_ledger(
    ledger: Ledger,
) -> None:
    """The check reads the heartbeat index: a node that heartbeats stays up, a silent one is
    lost once (and leaves the candidates), one registered again is watched again; a ledger
    written before the index (no ``node-seen``) is indexed from its node records and reaped
    the same way."""
    for node in ("a", "b", "c"):
        assert (await ledger.register_node(node, [device_spec(node, 0)], 1000, 1000)).ok
    seen = ledger.key("node-seen")
    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("a")).ok
    assert sorted((await ledger.reap_nodes(100)).lost) == ["b", "c"]
    assert await ledger.redis.zrangebyscore(seen, "-inf", "+inf") == [b"a", b"b", b"c"]
    assert await ledger.redis.zscore(seen, "b") == float("inf")  # lost: no longer a candidate
    assert (await ledger.reap_nodes(100)).lost == []
    assert (await ledger.register_node("b", [device_spec("b", 0)], 1000, 1000)).ok
    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("a")).ok
    assert (await ledger.reap_nodes(100)).lost == ["b"]

    await ledger.redis.delete(seen)  # as a ledger from before the index
    assert (await ledger.register_node("c", [device_spec("c", 0)], 1000, 1000)).ok
    await ledger.redis.zrem(seen, "c")
    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("a")).ok
    await ledger.redis.zrem(seen, "a")
    assert (await ledger.reap_nodes(100)).lost == ["c"]
    assert await ledger.redis.zcard(seen) == 3
    assert [n.status for n in await ledger.nodes()] == ["up", "lost", "lost"]
    assert await audit(ledger) == []


async def test_preemption_request_is_marked_and_queued_once(ledger: Ledger) -> None:
    """Marking a victim and queueing its EndLease happen together, once per (lease, job)."""
    await _two_gpus(ledger)
    await ledger.reserve(reservation("victim", SliceClaim("n1/nvidia0", whole=True)))
    await ledger.grant("lease-victim")
    outbox = ledger.key("outbox", "scheduler")
    before = await ledger.redis.xlen(outbox)
    assert (await ledger.request_preemption("lease-victim", "urgent")).ok
    assert (await ledger.request_preemption("lease-victim", "urgent")).duplicate
    entries = await ledger.redis.xrange(outbox)
    assert await ledger.redis.xlen(outbox) == before + 1
    assert entries and entries[-1][1] and entries[-1][1][b"kind"] == b"end_lease"
    lease = await ledger.get_lease("lease-victim")
    assert lease is not None and lease.preempted_for == "urgent"


async def test_admission_is_idempotent_and_orders_by_priority_then_arrival(ledger: Ledger) -> None:
    """A job id is admitted once (its request again keeps the first admission and its reason;
    another request under it is refused), a job that went further is not re-admitted, and the
    queue puts higher priority first."""
    assert (await ledger.pend("low", 100, b'{"n": 1}', None, "queued")).ok
    await asyncio.sleep(0.01)
    assert (await ledger.pend("high", 900, b'{"n": 2}', None, "queued")).ok
    await ledger.note_pending("low", "insufficient_capacity")
    again = await ledger.pend("low", 100, b'{"n": 1}', None, "queued")
    assert again.ok and again.duplicate
    other = await ledger.pend("low", 100, b'{"n": 3}', None, "queued")
    assert not other.ok and other.reason == "duplicate_job" and "pending" in other.detail
    jobs = await ledger.pending_jobs()
    assert [job.job_id for _, job in jobs] == ["high", "low"]
    assert jobs[1][0] == b'{"n": 1}' and jobs[1][1].reason == "insufficient_capacity"
    await _two_gpus(ledger)
    await ledger.reserve(reservation("high", SliceClaim("n1/nvidia0", whole=True)))
    refused = await ledger.pend("high", 900, b'{"n": 2}', None, "queued")
    assert not refused.ok and refused.reason == "job_reserved"
    other = await ledger.pend("high", 900, b"{}", None, "queued")
    assert not other.ok and other.reason == "duplicate_job" and "reserved" in other.detail


async def test_a_wait_is_noted_only_while_the_job_waits(ledger: Ledger) -> None:
    """A cycle notes why a job waits on a list read before the job ended (cancelled by its
    tenant here): the note is refused, so no JobPending follows its terminal event, and a job
    whose record is gone gets no record made of the note alone."""
    assert (await ledger.pend("w", 100, b"{}", None, "queued", tenant="acme")).ok
    assert await ledger.note_pending("w", "insufficient_capacity", "full", nominated=False)
    job = await ledger.get_job("w")
    assert job is not None and job.reason == "insufficient_capacity"
    assert (await ledger.cancel_job("w", "acme")).ok
    assert not await ledger.note_pending("w", "quota_exhausted", "later")
    job = await ledger.get_job("w")
    assert job is not None and job.state == "cancelled" and job.reason != "quota_exhausted"
    assert not await ledger.note_pending("never-pended", "insufficient_capacity")
    assert await ledger.redis.exists(ledger.key("job", "never-pended")) == 0


async def test_a_cycle_listing_times_out_first_and_survives_a_server_without_its_scripts(
    ledger: Ledger,
) -> None:
    """The listing a scheduling cycle reads (one round trip: the time-outs, then the pending
    jobs with their bodies and records) ends the requests past their max wait before it lists,
    leaves out a job whose request is gone, and on a server that lost its scripts loads them and
    asks again: each request is timed out once."""
    assert (await ledger.pend("due", 500, b'{"n": 1}', 1, "queued")).ok
    assert (await ledger.pend("kept", 400, b'{"n": 2}', None, "queued")).ok
    assert (await ledger.pend("gone", 300, b'{"n": 3}', None, "queued")).ok
    await ledger.redis.delete(ledger.key("pending-req", "gone"))
    await asyncio.sleep(0.01)
    await ledger.redis.script_flush()
    outbox = ledger.key("outbox", "scheduler")
    before = await ledger.redis.xlen(outbox)
    jobs = await ledger.pending_jobs(time_out_first=True)
    assert [(body, job.job_id) for body, job in jobs] == [(b'{"n": 2}', "kept")]
    assert jobs[0][1].since_ms and jobs[0][1].state == "pending"
    assert await ledger.redis.xlen(outbox) == before + 1  # the one time-out's event
    assert [job.job_id for _, job in await ledger.pending_jobs(time_out_first=True)] == ["kept"]
    assert await ledger.redis.xlen(outbox) == before + 1


async def test_partition_spec_and_enforced_slice_survive_the_scripts(ledger: Ledger) -> None:
    """A MIG instance's spec comes back from the ledger with its partition, and a slice the
    scheduler marked enforced is still enforced when the lease is read back."""
    mig = msgspec.structs.replace(
        device_spec("n1", 0, 40960),
        device_id="n1/nvidia0/mig1.0",
        uuid="MIG-1",
        isolation=["mig"],
        parent_uuid="GPU-n1-0",
        partition=PartitionSpec(kind="mig", profile="3g.40gb", gpu_slices=3, compute_slices=3),
    )
    assert (await ledger.register_node("n1", [mig, device_spec("n1", 1)], 64_000, 256_000)).ok
    (node,) = await ledger.nodes()
    assert node.devices[0].spec == mig
    meta = SliceMeta(vendor="nvidia", model="A100", index=1, uuid="GPU-n1-1", enforced=True)
    claims = (SliceClaim("n1/nvidia1", 1024, 10, meta=meta), SliceClaim("n1/nvidia0/mig1.0", 0))
    assert (await ledger.reserve(reservation("e", *claims))).ok
    lease = await ledger.get_lease("lease-e")
    assert lease is not None
    slices = {s.device_id: s.to_contract() for s in lease.slices}
    assert slices["n1/nvidia1"].enforced and not slices["n1/nvidia0/mig1.0"].enforced


async def test_a_draining_node_takes_no_new_grant_and_keeps_its_leases(ledger: Ledger) -> None:
    """Draining refuses new slices and host charges on the node (whatever a scheduler's snapshot
    said), keeps the lease already there, is in the change log and the node record, and undrain
    takes the node back."""
    await _two_gpus(ledger)
    assert (await ledger.reserve(reservation("kept", SliceClaim("n1/nvidia0", whole=True)))).ok
    cursor = (await ledger.changes_since(None)).cursor
    drained = await ledger.set_node_draining("n1", True)
    assert drained.ok and drained.previous == "in_service"
    changes = await ledger.changes_since(cursor)
    assert changes.complete and "n1" in changes.nodes
    (node,) = await ledger.nodes()
    assert node.draining
    refused = await ledger.reserve(reservation("new", SliceClaim("n1/nvidia1", whole=True)))
    assert not refused.ok and refused.reason == "node_draining"
    host_only = reservation("host", host={"n1": HostClaim(1000, 1024)})
    refused = await ledger.reserve(host_only)
    assert not refused.ok and refused.reason == "node_draining"
    assert [lease.job_id for lease in await ledger.leases()] == ["kept"]
    assert (await ledger.set_node_draining("n1", False)).previous == "draining"
    assert (await ledger.reserve(reservation("new", SliceClaim("n1/nvidia1", whole=True)))).ok
    assert not (await ledger.set_node_draining("nope", True)).ok
    assert await audit(ledger) == []


async def test_pool_shapes_are_read_back_and_a_bad_record_reads_as_none(ledger: Ledger) -> None:
    """The autoscaler's pool shapes round-trip; a record that does not decode is no shapes
    (the scheduler then rejects as if no pool existed) rather than an error."""
    from xpupool.contracts import PoolShape

    assert await ledger.pool_shapes() == []
    shape = PoolShape(pool="p", devices=[device_spec("p#shape", 0)], cpu_milli=8000, max_size=2)
    key = ledger.key("autoscaler", "shapes")
    await ledger.redis.set(key, msgspec.json.encode([shape]))
    assert await ledger.pool_shapes() == [shape]
    await ledger.redis.set(key, b"not json")
    assert await ledger.pool_shapes() == []


async def test_incoming_jobs_last_until_their_scale_up_is_overdue(ledger: Ledger) -> None:
    """The jobs in-flight scale-ups are for, each until its deadline; a bad record is none."""
    assert await ledger.incoming_jobs(0.0) == frozenset()
    key = ledger.key("autoscaler", "incoming")
    await ledger.redis.set(key, msgspec.json.encode({"j1": 100.0, "j2": 200.0}))
    assert await ledger.incoming_jobs(150.0) == {"j2"}
    assert await ledger.incoming_jobs(50.0) == {"j1", "j2"}
    await ledger.redis.set(key, b"[1, 2]")
    assert await ledger.incoming_jobs(0.0) == frozenset()


async def test_growth_reads_shapes_and_incoming_jobs_in_one_call(ledger: Ledger) -> None:
    """What a scheduling cycle reads of the autoscaler: the same as the two reads apart."""
    from xpupool.contracts import PoolShape

    empty = await ledger.growth()
    assert empty.shapes == [] and empty.incoming(0.0) == frozenset()
    shape = PoolShape(pool="p", devices=[device_spec("p#shape", 0)], max_size=1)
    await ledger.redis.set(ledger.key("autoscaler", "shapes"), msgspec.json.encode([shape]))
    await ledger.redis.set(ledger.key("autoscaler", "incoming"), msgspec.json.encode({"j": 9.0}))
    growth = await ledger.growth()
    assert growth.shapes == [shape]
    assert growth.incoming(5.0) == await ledger.incoming_jobs(5.0) == frozenset({"j"})
    assert growth.incoming(10.0) == await ledger.incoming_jobs(10.0) == frozenset()


async def test_a_reader_that_keeps_its_nodes_is_sent_only_the_devices_that_changed(
    ledger: Ledger,
) -> None:
    """Telemetry changes one device of an eight-device node: a reader that passes the nodes it
    read before gets that device's hash alone (the script sends nil for the seven others) and
    still the whole node, equal to a fresh read; a reader without them gets every hash, and a
    reader whose copy lacks a device is left to read that node whole."""
    assert (await ledger.register_node("n1", [device_spec("n1", i) for i in range(8)])).ok
    cursor = (await ledger.changes_since(None)).cursor
    known = {node.node_id: node for node in await ledger.nodes()}
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia3", util_pct=42.0)])).ok

    raw = await ledger._scripts["read_changes"](keys=[ledger.prefix], args=[cursor.seq, 256, "1"])
    [(_, _, _, device_ids, rows)] = raw[2]
    sent = [d.decode() for d, row in zip(device_ids, rows, strict=True) if row is not None]
    assert sent == ["n1/nvidia3"]

    [fresh] = await ledger.nodes()
    assert fresh.devices[3].util_pct == 42.0
    changes = await ledger.changes_since(cursor, max_records=256, known=known)
    assert changes.records is not None and changes.records.nodes == {"n1": fresh}
    everything = await ledger.changes_since(cursor, max_records=256)
    assert everything.records is not None and everything.records.nodes == {"n1": fresh}
    lacking = {"n1": dataclasses.replace(known["n1"], devices=known["n1"].devices[:7])}
    partial = await ledger.changes_since(cursor, max_records=256, known=lacking)
    assert partial.records is not None and partial.records.nodes == {}


async def test_a_reader_is_sent_the_hash_of_live_leases_only(ledger: Ledger) -> None:
    """A lease that ended since the cursor is named as gone, without its hash (most of what an
    ended lease would cost the read); a live one comes whole, equal to a read of it."""
    assert (await ledger.register_node("n1", [device_spec("n1", i) for i in range(2)])).ok
    cursor = (await ledger.changes_since(None)).cursor
    for job, device in (("a", "n1/nvidia0"), ("b", "n1/nvidia1")):
        assert (await ledger.reserve(reservation(job, SliceClaim(device, whole=True)))).ok
    ended = await ledger.grant("lease-a", "s")
    assert (await ledger.release("lease-a", Holder("t", "s", ended.token))).ok

    raw = await ledger._scripts["read_changes"](keys=[ledger.prefix], args=[cursor.seq, 256, ""])
    rows = {lease_id.decode(): (live, row) for lease_id, live, row in raw[3]}
    assert rows["lease-a"] == (0, None)
    assert rows["lease-b"][0] == 1 and rows["lease-b"][1]
    changes = await ledger.changes_since(cursor, max_records=256)
    assert changes.records is not None
    assert changes.records.leases == {"lease-a": None, "lease-b": await ledger.get_lease("lease-b")}


async def test_lease_states_count_live_leases_a_chunk_at_a_time(ledger: Ledger) -> None:
    """What the lease gauge shows: live leases and reservations by state, as a full read of
    every lease counts them, whatever the chunk; an ended lease is not counted."""
    specs = [device_spec("n1", i) for i in range(8)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    for i in range(23):
        claim = SliceClaim(f"n1/nvidia{i % 8}", 1024, 1)
        assert (await ledger.reserve(reservation(f"j{i}", claim))).ok
    for i in range(9):
        assert (await ledger.grant(f"lease-j{i}")).ok
    granted = await ledger.grant("lease-j9", "s")
    assert (await ledger.release("lease-j9", Holder("t", "s", granted.token))).ok

    def by_state(leases: list[LeaseRecord]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for lease in leases:
            counts[lease.state] = counts.get(lease.state, 0) + 1
        return counts

    expected = by_state(await ledger.leases())
    assert expected == {"active": 9, "reserved": 13}
    for chunk in (1, 4, 1000):
        assert await ledger.lease_states(chunk) == expected
    await ledger.redis.delete(ledger.key("leases"))
    assert await ledger.lease_states() == {}


async def test_an_eight_device_gang_s_lease_record_stays_compact_live_and_ended(
    ledger: Ledger,
) -> None:
    """With the ledger's Redis settings (``LEDGER_HASH_MAX_LISTPACK_VALUE``), a lease record
    keeps Redis's compact encoding even for a gang of eight on a node with a long name and
    real-format device UUIDs: its slices' JSON is the one value that grows with the gang."""
    node = "gke-prod-a100-pool-7f3c9b2e-x1z4"  # a cloud node pool's name, as long as they come
    specs = [
        msgspec.structs.replace(device_spec(node, i), uuid=f"GPU-27b94a00-ed54-5c24-b1fd-{i:012d}")
        for i in range(8)
    ]
    await ledger.register_node(node, specs)
    gang = [SliceClaim(f"{node}/nvidia{i}", 81920, 100, whole=True) for i in range(8)]
    assert (await ledger.reserve(reservation("gang", *gang))).ok
    assert (await ledger.grant("lease-gang")).ok
    key = ledger.key("lease", "lease-gang")
    compact = {b"listpack", b"ziplist"}  # Redis 7's name for it, and 6.2's
    assert await ledger.redis.object("encoding", key) in compact
    assert (await ledger.end("lease-gang", "expired")).ok
    assert await ledger.redis.object("encoding", key) in compact
    assert len(await ledger.redis.hget(key, "slices") or b"") > 1000  # eight slices were there
