"""Top-level decisions: reasons, timeouts, batch accounting, contract events."""

from __future__ import annotations

from domain_builders import job, lease, node, snapshot

from xpupool.contracts.payloads import JobReserved
from xpupool.scheduler.domain import (
    PendingRequest,
    Reason,
    Reject,
    Reserve,
    TimedOut,
    Wait,
    WorkingPool,
    apply_decision,
    decide,
    decide_batch,
    default_config,
)

NOW = 10_000.0


def test_batch_never_over_allocates():
    """Ten whole-device requests against four devices: four reserved, six wait, no device reused."""
    snap = snapshot(node("n", "A100", 4), now=NOW)
    out = decide_batch([job(f"j{i}", tenant=f"t{i % 3}") for i in range(10)], snap)
    res = [d for _, d in out if isinstance(d, Reserve)]
    assert len(res) == 4
    assert len({s.device_id for d in res for s in d.slices}) == 4
    assert all(
        isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY
        for _, d in out
        if not isinstance(d, Reserve)
    )


def test_a_batch_leaves_its_last_decision_out_of_the_pool_when_asked():
    """``apply_last=False``: every reservation but the last is in the pool, so the batch still
    never over-allocates, and the decisions are those of a batch that applies them all."""
    applied = WorkingPool(snapshot(node("n", "A100", 4), now=NOW), default_config())
    kept = WorkingPool(snapshot(node("n", "A100", 4), now=NOW), default_config())
    requests = [job(f"j{i}", compute_pct=60) for i in range(3)]
    every = decide_batch(requests, applied)
    all_but_last = decide_batch(requests, kept, apply_last=False)
    assert all_but_last == every
    reserved = [d.job_id for _, d in every if isinstance(d, Reserve)]
    assert len(reserved) == 3
    assert f"reservation:{reserved[-1]}" in applied.leases
    assert f"reservation:{reserved[-1]}" not in kept.leases
    assert {f"reservation:{j}" for j in reserved[:-1]} <= set(kept.leases)
    lone = WorkingPool(snapshot(node("n", "A100", 1), now=NOW), default_config())
    [(_, decision)] = decide_batch([job("lone")], lone, apply_last=False)
    assert isinstance(decision, Reserve)
    assert not lone.leases


def test_shares_pack_within_a_batch():
    """Shares in one batch share devices up to their memory and compute, never beyond."""
    snap = snapshot(node("n", "A100", 1), now=NOW)
    out = decide_batch([job(f"j{i}", compute_pct=30) for i in range(4)], snap)
    assert sum(isinstance(d, Reserve) for _, d in out) == 3


def test_max_wait_expiry_times_out_with_last_reason():
    """A request past max_wait_s that still cannot fit ends with TimedOut carrying the reason."""
    snap = snapshot(node("n", "A100", 1), leases=(lease("l", ["n/0"], priority=1000),), now=NOW)
    item = PendingRequest(job("j", max_wait_s=60.0), NOW - 61)
    d = decide_batch([item], snap)[0][1]
    assert isinstance(d, TimedOut) and d.last_reason is Reason.INSUFFICIENT_CAPACITY
    assert d.waited_s >= 60.0
    fresh = PendingRequest(job("j", max_wait_s=60.0), NOW - 10)
    assert isinstance(decide_batch([fresh], snap)[0][1], Wait)


def test_expired_request_that_fits_is_still_served():
    """Expiry only ends a job that would otherwise wait; one that fits is reserved."""
    snap = snapshot(node("n", "A100", 1), now=NOW)
    assert isinstance(
        decide_batch([PendingRequest(job("j", max_wait_s=1.0), 0.0)], snap)[0][1], Reserve
    )


def test_rejections_come_first_and_do_not_consume():
    """Invalid requests are rejected in the batch without affecting the others."""
    snap = snapshot(node("n", "A100", 1), now=NOW)
    out = dict(decide_batch([job("bad", priority="nope"), job("ok")], snap))
    assert isinstance(out["bad"], Reject) and isinstance(out["ok"], Reserve)


def test_reserve_to_contract_event():
    """Reserve converts to the JobReserved contract event with the shell's lease id."""
    d = decide(job("j", memory_mib=1000), snapshot(node("n", "A100", 1)))
    assert isinstance(d, Reserve)
    ev = d.to_event("lease-1")
    assert isinstance(ev, JobReserved) and ev.lease_id == "lease-1" and ev.slices == list(d.slices)


def test_no_matching_healthy_device_reason():
    """When every matching device is unhealthy the job waits with no_matching_device."""
    snap = snapshot(node("n", "A100", 2, health="unhealthy"), node("m", "T4", 2))
    d = decide(job("j", models=["A100"]), snap)
    assert isinstance(d, Wait) and d.reason is Reason.NO_MATCHING_DEVICE


def test_apply_decision_then_release_restores_pool():
    """Applying a reservation and releasing it leaves the working pool exactly as before."""
    pool = WorkingPool(snapshot(node("n", "A100", 2, cpu=1000)), default_config())
    before = (list(pool.dev_mem_free), list(pool.dev_holders), list(pool.node_cpu_free))
    d = decide(job("j", count=2, cpu_milli=500), pool)
    apply_decision(pool, d)
    assert pool.dev_holders == [1, 1] and pool.node_cpu_free == [500]
    pool.release("reservation:j")
    assert (pool.dev_mem_free, pool.dev_holders, pool.node_cpu_free) == before
    assert not pool.violations()


def test_every_reason_is_in_the_vocabulary():
    """Wait and Reject reasons are Reason members, so the shell publishes a fixed vocabulary."""
    snap = snapshot(node("n", "A100", 1), leases=(lease("l", ["n/0"], priority=1000),), now=NOW)
    for r in [job("a"), job("b", models=["X"]), job("c", memory_mib=10**6)]:
        d = decide(r, snap)
        assert isinstance(d, Wait | Reject) and isinstance(d.reason, Reason)
