"""The default ``xpupool`` policy: intent tiers first, fragmentation within a tier, shapes learned
once per request, gangs the trace view cannot express left to the engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from domain_builders import job, lease, node, snapshot

from xpupool.contracts.payloads import GangSpec, Intent
from xpupool.placement import PolicyContext, ShapeDistribution, make_policy
from xpupool.placement.default import DefaultPolicy
from xpupool.placement.demand import make_demand
from xpupool.placement.inventory import HostCharge, PoolSnapshot
from xpupool.placement.node_policies import NodeView, make_trace_policies
from xpupool.replay.arrivals import (
    RecordedPolicy,
    build_fgd_workload,
    fgd_cluster,
    replay_arrivals,
)
from xpupool.replay.scheduler_default import decide_arrivals
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods
from xpupool.scheduler.domain import (
    PolicyRegistry,
    Reserve,
    Wait,
    WorkingPool,
    decide,
    decide_batch,
    default_config,
)


def _registry() -> tuple[PolicyRegistry, DefaultPolicy]:
    policy = DefaultPolicy.create()
    return policy.cycle_registry(default_config().placement), policy


def _reserve(snap: PoolSnapshot, request: object, registry: PolicyRegistry) -> Reserve:
    d = decide(request, snap, policies=registry)  # type: ignore[arg-type]
    assert isinstance(d, Reserve), d
    assert d.policy == "xpupool"
    return d


def test_it_is_the_default_and_keeps_the_classic_judgements() -> None:
    registry, policy = _registry()
    assert registry.get(None) is policy
    assert policy.base is not policy and policy.base.name == "heuristic"


def test_intent_ranks_classes_before_fragmentation() -> None:
    """A cheap share goes to the cheap T4 even though a half-used A100 is a tighter fit; asked
    to be fast, the same share goes to the A100 that is already shared."""
    half = lease("l1", ["a/0"], share=(40960, 50))
    snap = snapshot(node("a", "A100", 2), node("t", "T4", 2), leases=(half,))
    registry, _ = _registry()
    cheap = _reserve(snap, job("cheap", compute_pct=50), registry)
    assert cheap.slices[0].model == "T4"
    fast = _reserve(snap, job("fast", compute_pct=50, intent=Intent.FASTEST), registry)
    assert fast.slices[0].device_id == "a/0"


def test_within_a_tier_a_share_keeps_whole_devices_whole() -> None:
    """Among equal A100 nodes, with whole-device work in the learned mix (a live whole lease),
    a half share fills the half-used device, on whichever node it is: first-fit by name would
    break the whole device left on node ``a``."""
    half = lease("l1", ["b/1"], share=(40960, 50))
    whole = lease("l2", ["a/0"])
    snap = snapshot(node("a", "A100", 2), node("b", "A100", 2), leases=(half, whole))
    registry, _ = _registry()
    d = _reserve(snap, job("j", compute_pct=50), registry)
    assert d.slices[0].device_id == "b/1"


def test_a_waiting_request_is_learned_once_and_leases_seed_the_learner() -> None:
    busy = lease("l1", ["a/0", "a/1"], host=(HostCharge("a", 4000, 0),))
    snap = snapshot(node("a", "A100", 2), leases=(busy,))
    registry, policy = _registry()
    for _ in range(3):  # three cycles: the request waits in each
        out = decide_batch([job("big", count=2, gang=GangSpec())], snap, policies=registry)
        assert isinstance(out[0][1], Wait)
    assert policy.online.learner.observed == 2  # the live lease, then the request, once each
    dist = policy.online.learner.distribution()
    assert dist is not None and {s.num_gpu for s in dist.shapes} == {2}


def test_warming_builds_what_the_first_decision_needs_and_decides_the_same() -> None:
    """``warm`` (the scheduler's idle read) builds the node view and seeds the learner; the
    decisions that follow are those of a policy that was not warmed."""
    live = (lease("l1", ["b/1"], share=(40960, 50)), lease("l2", ["a/0"]))
    snap = snapshot(node("a", "A100", 2), node("b", "A100", 2), node("t", "T4", 2), leases=live)
    requests = [job(f"j{i}", compute_pct=25 * (1 + i % 3)) for i in range(6)]
    decided = []
    for warm in (False, True):
        registry, policy = _registry()
        pool = WorkingPool(snap, default_config())
        if warm:
            policy.warm(pool)
            assert policy.online.learner.observed == 2  # the two live leases
            assert policy.view(pool).matches(pool)
        decided.append(decide_batch(requests, pool, policies=registry))
    assert decided[0] == decided[1]
    assert all(isinstance(d, Reserve) for _, d in decided[1])


def test_same_domain_gangs_stay_in_one_domain() -> None:
    """The trace view does not know interconnect domains: such gangs go to the engine."""
    devs = node("a", "A100", 8)
    left = tuple(replace(d, domain="nv0" if d.index < 4 else "nv1") for d in devs.devices)
    taken = lease("l1", ["a/0", "a/1"])  # the first three free devices span both domains
    snap = snapshot(replace(devs, devices=left), leases=(taken,))
    registry, _ = _registry()
    d = _reserve(
        snap, job("g", count=3, gang=GangSpec(same_node=False, same_domain=True)), registry
    )
    domains = {"nv0" if int(s.device_id.split("/")[1]) < 4 else "nv1" for s in d.slices}
    assert len(domains) == 1


TRACE = find_trace_dir(Path(__file__).resolve())


@pytest.mark.skipif(TRACE is None, reason="the Alibaba trace is not beside the repository")
def test_the_default_allocates_at_least_as_much_as_fgd_on_a_reduced_trace() -> None:
    """A regression guard for the bench: every 10th node and pod of the default trace, FGD
    protocol, seed 42; the scheduler's own decisions (learned default, told nothing about the
    trace) never allocate less than FGD at any reported arrival point (measured ahead by 2.1
    points at 100 %; seeds 42-47 all ahead by 0.5 to 2.2)."""
    assert TRACE is not None
    nodes = fgd_cluster(load_nodes(TRACE / "openb_node_list_gpu_node.csv")[::10], 42)
    pods = [p.demand for p in load_pods(TRACE / "openb_pod_list_default.csv")][::10]
    typical = ShapeDistribution.typical(pods)
    workload = build_fgd_workload(pods, 42, sum(n.num_gpu for n in nodes) * 1000)
    ctx = PolicyContext(rng=np.random.default_rng(42), workload=pods, typical=typical)
    fgd = replay_arrivals(nodes, workload, make_policy("fgd", ctx), typical)
    outcomes, _ = decide_arrivals(nodes, workload)
    ours = replay_arrivals(nodes, workload, RecordedPolicy("xpupool", outcomes), typical)
    assert sum(o is not None for o in outcomes) > 500
    for pct in (90, 95, 100, 110, 130):
        assert ours.alloc_at(pct) >= fgd.alloc_at(pct), pct
    assert ours.alloc_at(100) > fgd.alloc_at(100)


def test_every_device_of_a_mixed_node_is_in_the_node_view() -> None:
    """A node with two models is two rows of the view: the second model is placed on by the
    node-view policies themselves (it used to be invisible to them)."""
    mixed = node("m", "T4", 2)
    a100 = node("m", "A100", 2).devices
    both = replace(mixed, devices=(*mixed.devices, *(replace(d, index=d.index + 2) for d in a100)))
    both = replace(both, devices=tuple(replace(d, device_id=f"m/{d.index}") for d in both.devices))
    pool = WorkingPool(snapshot(both), default_config())
    view = NodeView(pool, {})
    assert (view.dev_row >= 0).all()
    assert [view.state.names[r] for r in range(view.state.num_nodes)] == ["m", "m#A100"]
    (bestfit,) = make_trace_policies(names=["bestfit"])
    demand = make_demand(job("j", count=2, models=["A100"]), pool)
    placed = bestfit.place_pool(pool, demand, demand.classes)
    assert placed is not None
    assert {pool.devices[i].model for i in placed.devices} == {"A100"}
    assert placed.host[0][0] == pool.node_index["m"]


def test_a_share_the_views_rounding_would_refuse_is_placed() -> None:
    """20,000 MiB free of 81,920 is 244 whole milli-GPU in the view; a 20,000 MiB share is 245.
    The pool says it fits, so the node-view policy places it (the view never decides
    feasibility on its own)."""
    one = node("n", "A100", 1)
    total = one.devices[0].memory_total_mib
    snap = snapshot(one, leases=(lease("l", ["n/0"], share=(total - 20_000, 10)),))
    pool = WorkingPool(snap, default_config())
    (bestfit,) = make_trace_policies(names=["bestfit"])
    demand = make_demand(job("j", memory_mib=20_000), pool)
    placed = bestfit.place_pool(pool, demand, demand.classes)
    assert placed is not None and placed.devices == (0,)
    too_big = make_demand(job("k", memory_mib=20_001), pool)
    assert bestfit.place_pool(pool, too_big, too_big.classes) is None


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_view_synced_from_the_pools_change_log_equals_a_fresh_one(seed: int) -> None:
    """The node view compares only the rows of devices and nodes the pool logged since its last
    sync: after random grants and releases (shares, whole devices, host charges, a mixed node,
    the log starting over) it holds exactly what a view built and synced anew holds."""
    rng = np.random.default_rng(seed)
    mixed = node("m", "T4", 2)
    a100 = node("m", "A100", 2).devices
    both = replace(mixed, devices=(*mixed.devices, *(replace(d, index=d.index + 2) for d in a100)))
    both = replace(both, devices=tuple(replace(d, device_id=f"m/{d.index}") for d in both.devices))
    pool = WorkingPool(snapshot(node("a", "A100", 4), node("t", "T4", 3), both), default_config())
    kept = NodeView(pool, {})
    kept.sync(pool)
    devices = [d.device_id for d in pool.devices]
    live: list[str] = []
    for k in range(200):
        if live and rng.random() < 0.4:
            pool.release(live.pop(int(rng.integers(len(live)))))
        else:
            chosen = list(rng.choice(devices, size=int(rng.integers(0, 3)), replace=False))
            whole = rng.random() < 0.3
            node_id = chosen[0].split("/")[0] if chosen else "a"
            grant = lease(
                f"l{k}",
                chosen,
                share=None if whole else (1024, 10),
                host=(HostCharge(node_id, int(rng.integers(0, 4000)), 1024),),
            )
            if not any(pool.dev_exclusive[pool.dev_index[d]] for d in chosen) and (
                not whole or all(pool.dev_holders[pool.dev_index[d]] == 0 for d in chosen)
            ):
                pool.add_lease(grant)
                live.append(grant.lease_id)
        if k == 120:
            pool.counter_changes_epoch += 1  # as when the log is cut: the next sync is whole
        if rng.random() < 0.5:
            kept.sync(pool)
    kept.sync(pool)
    fresh = NodeView(pool, {})
    fresh.sync(pool)
    for name in ("gpu_free", "cpu_free", "mem_free", "class_counts", "pod_count"):
        assert getattr(kept.state, name).tolist() == getattr(fresh.state, name).tolist(), name
