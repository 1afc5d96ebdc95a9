"""Host-only leases (``count: 0``: host CPU and memory on one node, no slice) through every
ledger transition against a real redis-server, with the audit proving the host counters."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.ledger import Holder, HostClaim, Ledger, Reservation, SliceClaim, UsageClaim, audit

pytestmark = pytest.mark.integration

CPU, MEMORY = 64_000, 256_000


def _host_only(job: str, cpu: int = 4000, memory: int = 8192, **kwargs: object) -> Reservation:
    return reservation(job, **{"host": {"n1": HostClaim(cpu, memory)}, **kwargs})


async def _node(ledger: Ledger) -> None:
    result = await ledger.register_node("n1", [device_spec("n1", 0)], CPU, MEMORY)
    assert result.ok


async def _host_free(ledger: Ledger) -> tuple[int, int]:
    node = (await ledger.nodes())[0]
    return node.cpu_free_milli, node.memory_free_mib


async def _outbox_kinds(ledger: Ledger) -> list[object]:
    entries: Any = await ledger.redis.xrange(ledger.key("outbox", "lease-manager"))
    return [fields[b"kind"] for _, fields in entries]


async def test_host_only_lease_reserves_grants_renews_and_releases(ledger: Ledger) -> None:
    """A lease with no slices holds host CPU and memory through its whole life, and gives them
    back (and nothing else) when released; the audit stays clean at every step."""
    await _node(ledger)
    reserved = await ledger.reserve(_host_only("h"))
    assert reserved.ok, reserved
    lease = await ledger.get_lease("lease-h")
    assert lease is not None and lease.state == "reserved"
    assert lease.slices == [] and lease.host == {"n1": HostClaim(4000, 8192)}
    assert await _host_free(ledger) == (CPU - 4000, MEMORY - 8192)
    assert (await ledger.nodes())[0].devices[0].holders == 0
    assert await audit(ledger) == []

    granted = await ledger.grant("lease-h", "secret")
    assert granted.ok and granted.token > 0
    holder = Holder("t", "secret", granted.token)
    assert (await ledger.renew("lease-h", holder, 120_000)).ok
    assert await audit(ledger) == []

    assert (await ledger.release("lease-h", holder)).ok
    assert await _host_free(ledger) == (CPU, MEMORY)
    ended = await ledger.get_lease("lease-h")
    assert ended is not None and ended.end_reason == "released"
    assert await _outbox_kinds(ledger) == [b"granted", b"renewed", b"ended"]
    assert await ledger.leases() == []
    assert await audit(ledger) == []


async def test_host_only_quota_counters_come_back(ledger: Ledger) -> None:
    """Usage a host-only reservation carries (none, or a zero claim) is given back on end."""
    await _node(ledger)
    claim = [UsageClaim("q", "units", 0.0, 1.0)]
    assert (await ledger.reserve(_host_only("none"))).ok
    assert (await ledger.reserve(_host_only("zero", usage=claim))).ok
    assert (await ledger.get_lease("lease-none")) is not None
    await ledger.end("lease-none", "released")
    await ledger.end("lease-zero", "released")
    assert (await ledger.usage("q")).get("units", 0.0) == pytest.approx(0.0)
    assert await _host_free(ledger) == (CPU, MEMORY)
    assert await audit(ledger) == []


async def test_host_only_lease_and_reservation_expire(ledger: Ledger) -> None:
    """An unrenewed host-only lease and an unclaimed host-only reservation both expire and give
    their host resources back."""
    await _node(ledger)
    assert (await ledger.reserve(_host_only("lease", ttl_ms=200))).ok
    await ledger.grant("lease-lease")
    assert (await ledger.reserve(_host_only("unclaimed", cpu=1000, memory=10, hold_ms=200))).ok
    assert await _host_free(ledger) == (CPU - 5000, MEMORY - 8202)
    await asyncio.sleep(0.3)
    assert sorted((await ledger.expire_due()).ended) == ["lease-lease", "lease-unclaimed"]
    assert await _host_free(ledger) == (CPU, MEMORY)
    assert await audit(ledger) == []


async def test_host_only_lease_ends_lost_with_its_node(ledger: Ledger) -> None:
    """A node that stops heartbeating ends the host-only leases on it as lost."""
    await _node(ledger)
    assert (await ledger.reserve(_host_only("h"))).ok
    await ledger.grant("lease-h")
    await asyncio.sleep(0.2)
    assert (await ledger.reap_nodes(100)).lost == ["n1"]
    lease = await ledger.get_lease("lease-h")
    assert lease is not None and lease.state == "ended" and lease.end_reason == "lost"
    assert await _host_free(ledger) == (CPU, MEMORY)
    assert await audit(ledger) == []
    refused = await ledger.reserve(_host_only("after"))
    assert not refused.ok and refused.reason == "node_down"


async def test_host_only_refusals_write_nothing(ledger: Ledger) -> None:
    """Too much CPU, an unknown node, or a reservation of nothing at all: refused, no trace."""
    await _node(ledger)
    assert (await ledger.reserve(_host_only("fits", cpu=CPU - 1000))).ok
    refused = await ledger.reserve(_host_only("big", cpu=2000))
    assert not refused.ok and refused.reason == "insufficient_host_resources"
    unknown = await ledger.reserve(_host_only("far", host={"n9": HostClaim(1, 1)}))
    assert not unknown.ok and unknown.reason == "node_down"
    empty = await ledger.reserve(_host_only("empty", host={}))
    assert not empty.ok and empty.reason == "empty_reservation"
    for job in ("big", "far", "empty"):
        assert await ledger.get_job(job) is None
    assert await _host_free(ledger) == (1000, MEMORY - 8192)
    assert await audit(ledger) == []


async def test_host_only_next_to_a_device_lease(ledger: Ledger) -> None:
    """Host-only and device leases share a node's host counters; the audit sums them both."""
    await _node(ledger)
    device = _host_only("gpu", cpu=2000, memory=100, slices=[SliceClaim("n1/nvidia0", whole=True)])
    assert (await ledger.reserve(device)).ok
    assert (await ledger.reserve(_host_only("cpu"))).ok
    assert await _host_free(ledger) == (CPU - 6000, MEMORY - 8292)
    assert await audit(ledger) == []
    await ledger.end("lease-gpu", "released")
    assert await _host_free(ledger) == (CPU - 4000, MEMORY - 8192)
    assert await audit(ledger) == []


async def test_audit_catches_a_host_counter_that_drifted(ledger: Ledger) -> None:
    """The audit proves the host counters: one that disagrees with the leases is reported."""
    await _node(ledger)
    assert (await ledger.reserve(_host_only("h"))).ok
    await ledger.redis.hincrby(ledger.key("node", "n1"), "cpu_free", 500)
    problems = await audit(ledger)
    assert problems == ["node n1 CPU counter 3500 != leased 4000"]
