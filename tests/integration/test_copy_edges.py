"""Edges of the ledger's consistency and of the scheduler's kept copy of it: the indexes the
ledger's scripts find a node's or a device's leases by, and what the audit notices when the
ledger holds something no live lease accounts for."""

from __future__ import annotations

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.ledger import HostClaim, Ledger, SliceClaim, UsageClaim
from xpupool.ledger.audit import audit

pytestmark = pytest.mark.integration


async def _members(ledger: Ledger, *key: str) -> set[str]:
    raw = await ledger.redis.smembers(ledger.key(*key))
    return {m.decode() if isinstance(m, bytes) else str(m) for m in raw}


async def _two_gpus(ledger: Ledger) -> None:
    await ledger.register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 1)], cpu_milli=8000, memory_mib=65536
    )


async def test_an_ended_lease_leaves_the_lease_index_of_every_node_it_held(ledger: Ledger) -> None:
    """A lease on a node's devices without host CPU or memory there (a request's default: the
    scheduler sends no host charge of nothing) is indexed under that node as any lease is, and
    its end (end_lease, which every way of ending runs) takes it out again: otherwise every
    lease a node ever ran stays listed there, the set grows for ever, and the node's loss
    (reap_nodes.lua) walks all of them in one script, holding Redis for as long."""
    await _two_gpus(ledger)
    assert (await ledger.reserve(reservation("gpu-only", SliceClaim("n1/nvidia0", 1024, 50)))).ok
    both = reservation(
        "with-host", SliceClaim("n1/nvidia1", 1024, 50), host={"n1": HostClaim(500, 1024)}
    )
    assert (await ledger.reserve(both)).ok
    assert await _members(ledger, "node-leases", "n1") == {"lease-gpu-only", "lease-with-host"}
    assert (await ledger.end("lease-gpu-only", "released")).ok
    assert (await ledger.end("lease-with-host", "released")).ok
    assert await _members(ledger, "node-leases", "n1") == set()
    assert await _members(ledger, "dev-leases", "n1/nvidia0") == set()
    assert await audit(ledger) == []


async def test_the_audit_names_a_quota_counter_no_live_lease_holds(ledger: Ledger) -> None:
    """The quota counters must equal what the live leases' records say they added (their end
    gives back exactly that): a counter left holding an ended lease's share (a give-back that
    went missing) refuses the queue that much for ever, and one short of its leases lets the
    queue past its limit. The audit, which the fault and policy suites trust for this, names
    both."""
    await _two_gpus(ledger)
    claim = [UsageClaim("q", "units", 0.5, 1.0), UsageClaim("t", "devices:A100", 0.5)]
    held = reservation("held", SliceClaim("n1/nvidia0", 1024, 50), usage=claim)
    assert (await ledger.reserve(held)).ok
    assert await audit(ledger) == []
    # A lease's end that gave the counter back twice, and a counter nobody's lease holds.
    await ledger.redis.hincrbyfloat(ledger.key("usage", "q"), "units", -0.5)
    await ledger.redis.hincrbyfloat(ledger.key("usage", "other"), "units", 0.25)
    problems = await audit(ledger)
    assert any("q" in p and "units" in p for p in problems), problems
    assert any("other" in p and "units" in p for p in problems), problems
    assert not any("devices:A100" in p for p in problems), problems


async def test_the_audit_names_a_live_lease_a_device_or_node_does_not_index(
    ledger: Ledger,
) -> None:
    """A device's removal (register_node.lua) and a node's loss (reap_nodes.lua) end the leases
    their indexes list: a live lease missing from one would hold a vanished device's share, or a
    lost node's, for ever. The audit names such a lease, and an index entry no live lease
    accounts for."""
    await _two_gpus(ledger)
    assert (await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", 1024, 50)))).ok
    assert await audit(ledger) == []
    await ledger.redis.srem(ledger.key("dev-leases", "n1/nvidia0"), "lease-a")
    await ledger.redis.sadd(ledger.key("node-leases", "n1"), "lease-gone")
    problems = await audit(ledger)
    assert any("n1/nvidia0" in p and "lease-a" in p for p in problems), problems
    assert any("n1" in p and "lease-gone" in p for p in problems), problems
