"""The vectorized single-slice placement decides exactly like the straightforward scoring.

``WorkingPool.fast_placement = False`` forces the per-device Python scoring (the reference);
``True`` forces the numpy path wherever it applies, even on tiny classes, so hypothesis' small
pools exercise it too. Both must produce identical placements and identical batch decisions.
"""

from __future__ import annotations

import random
from dataclasses import replace

from domain_builders import CATALOG, device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sched_properties import NOW, configs, pools, streams

from xpupool.contracts.payloads import DeviceDemand, HostDemand, Intent, JobRequested
from xpupool.placement.demand import make_demand
from xpupool.placement.engine import HeuristicPolicy, place_in_class
from xpupool.scheduler.domain import (
    LeaseSlice,
    LeaseState,
    NodeState,
    PendingRequest,
    PoolSnapshot,
    SchedulerConfig,
    WorkingPool,
    apply_decision,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.decide import Decision

MODELS = sorted(CATALOG)


def _batch(
    snap: PoolSnapshot, cfg: SchedulerConfig, stream: list[PendingRequest], fast: bool
) -> list[tuple[str, Decision]]:
    wp = WorkingPool(snap, cfg)
    wp.fast_placement = fast
    return decide_batch(stream, wp, cfg)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=pools(), cfg=configs(), stream=streams())
def test_fast_batch_equals_reference(
    snap: PoolSnapshot, cfg: SchedulerConfig, stream: list[PendingRequest]
) -> None:
    """Whole batches (holds, preemption, explanations included) decide identically."""
    assert _batch(snap, cfg, stream, True) == _batch(snap, cfg, stream, False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    snap=pools(),
    demands=st.lists(
        st.tuples(
            st.sampled_from(["whole", "mem", "compute", "pct"]),
            st.integers(1, 90000),
            st.integers(0, 100),
            st.sampled_from([0, 2000, 16000, 64000]),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    ),
    hot=st.sampled_from([0.0, 50.0, 85.0]),
    typical=st.sampled_from([1, 10, 25]),
)
def test_fast_place_in_class_equals_reference(
    snap: PoolSnapshot,
    demands: list[tuple[str, int, int, int, bool]],
    hot: float,
    typical: int,
) -> None:
    """Every class, every single-slice shape, with and without held nodes: the same placement,
    score included, while the pool changes between placements."""
    cfg = default_config()
    cfg = replace(
        cfg, placement=replace(cfg.placement, hot_util_pct=hot, typical_share_pct=typical)
    )
    policy = HeuristicPolicy(cfg.placement)
    wp = WorkingPool(snap, cfg)
    for n, (kind, mem, comp, cpu, hold) in enumerate(demands):
        dd = {
            "whole": DeviceDemand(),
            "mem": DeviceDemand(memory_mib=mem, compute_pct=comp or None),
            "compute": DeviceDemand(compute_pct=max(comp, 1)),
            "pct": DeviceDemand(memory_pct=max(1, comp)),
        }[kind]
        req = JobRequested(job_id=f"j{n}", tenant="ta", device=dd, host=HostDemand(cpu_milli=cpu))
        demand = make_demand(req, wp)
        wp.held_nodes = {0} if hold else set()
        found = None
        for ci in range(len(wp.classes)):
            for respect in (True, False):
                wp.fast_placement = False
                ref = place_in_class(wp, demand, policy, ci, respect_holds=respect)
                wp.fast_placement = True
                got = place_in_class(wp, demand, policy, ci, respect_holds=respect)
                assert got == ref
                if respect and ref is not None and found is None:
                    found = ref
        if found is not None:
            # Take it, so the next placement runs against changed counters (mirror sync).
            wp.add_lease(
                LeaseState(
                    lease_id=f"x{n}",
                    job_id=f"j{n}",
                    tenant="ta",
                    queue="ta",
                    priority=500,
                    started_at_s=NOW,
                    slices=tuple(
                        LeaseSlice(
                            wp.devices[i].device_id,
                            wp.devices[i].memory_total_mib if found.whole else found.memory_mib,
                            100 if found.whole else found.compute_pct,
                            found.whole,
                        )
                        for i in found.devices
                    ),
                )
            )


def _large_pool(rng: random.Random, n_nodes: int) -> PoolSnapshot:
    """Big enough classes for the automatic choice to vectorize; random load and leases."""
    nodes = []
    leases = []
    for n in range(n_nodes):
        nid = f"n{n}"
        model = rng.choice(["T4", "A100"])
        devs = []
        for i in range(rng.choice([2, 4, 8])):
            d = device(nid, i, model, util_pct=rng.choice([None, 0.0, 30.0, 95.0]))
            r = rng.random()
            if r < 0.2:
                d = replace(d, memory_free_mib=0, compute_free_pct=0, exclusive=True, holders=1)
                sl = LeaseSlice(d.device_id, d.memory_total_mib, 100, True)
            elif r < 0.5:
                mem = d.memory_total_mib // rng.choice([2, 3, 4, 8])
                comp = rng.choice([10, 25, 50])
                d = replace(
                    d,
                    memory_free_mib=d.memory_total_mib - mem,
                    compute_free_pct=100 - comp,
                    holders=1,
                )
                sl = LeaseSlice(d.device_id, mem, comp, False)
            else:
                devs.append(d)
                continue
            devs.append(d)
            t = rng.choice(["ta", "tb"])
            leases.append(
                LeaseState(
                    lease_id=f"l{len(leases)}",
                    job_id=f"old{len(leases)}",
                    tenant=t,
                    queue=t,
                    priority=rng.choice([100, 500, 900]),
                    started_at_s=rng.uniform(0, NOW),
                    slices=(sl,),
                )
            )
        cpu = rng.choice([16000, 64000])
        nodes.append(NodeState(nid, tuple(devs), cpu, cpu, 256000, 256000))
    return PoolSnapshot(tuple(nodes), tuple(leases), NOW)


def _share_stream(rng: random.Random, n: int) -> list[PendingRequest]:
    out = []
    for i in range(n):
        dev = rng.choice(
            [
                DeviceDemand(),
                DeviceDemand(compute_pct=rng.randint(5, 40)),
                DeviceDemand(memory_mib=rng.choice([1024, 4096, 12000]), compute_pct=10),
            ]
        )
        req = JobRequested(
            job_id=f"j{i}",
            tenant=rng.choice(["ta", "tb", "tc"]),
            device=dev,
            intent=rng.choice(list(Intent)),
            host=HostDemand(cpu_milli=rng.choice([0, 2000, 8000])),
        )
        out.append(PendingRequest(req, NOW - rng.uniform(0, 100)))
    return out


def test_automatic_fast_path_on_large_pools_matches_reference() -> None:
    """Large classes take the numpy path on their own; the decisions equal the reference's."""
    for seed in range(3):
        rng = random.Random(seed)
        snap = _large_pool(rng, 60)
        stream = _share_stream(rng, 300)
        cfg = default_config()
        auto = WorkingPool(snap, cfg)
        assert auto.fast_placement is None
        got = decide_batch(stream, auto, cfg)
        assert got == _batch(snap, cfg, stream, False)
        # The mirrors stayed in step with every reservation of the batch.
        a = auto.arrays()
        assert a.mem_free.tolist() == auto.dev_mem_free
        assert a.node_cpu_free.tolist() == auto.node_cpu_free
        assert a.node_busy.tolist() == auto.node_busy


def test_mirrors_follow_release_and_restore() -> None:
    """``arrays()`` reflects releases and restores made after it was first built."""
    rng = random.Random(7)
    snap = _large_pool(rng, 10)
    wp = WorkingPool(snap, default_config())
    before = wp.arrays().mem_free.tolist()
    lids = list(wp.leases)[:5]
    released = wp.release_many(lids)
    assert wp.arrays().mem_free.tolist() == wp.dev_mem_free
    assert wp.arrays().holders.tolist() == wp.dev_holders
    wp.restore_many(released)
    assert wp.arrays().mem_free.tolist() == before
    for d in _batch(snap, default_config(), _share_stream(rng, 20), True):
        apply_decision(wp, d[1])
    assert wp.arrays().compute_free.tolist() == wp.dev_compute_free
    assert wp.arrays().exclusive.tolist() == wp.dev_exclusive
