"""Placement policies: heterogeneity, binpack/spread, load, fragmentation, topology, plug-ins."""

from __future__ import annotations

from dataclasses import replace

from domain_builders import job, lease, node, snapshot

from xpupool.contracts.payloads import GangSpec, Intent
from xpupool.placement.default import default_registry
from xpupool.placement.inventory import HostCharge
from xpupool.scheduler.domain import (
    PendingRequest,
    QueueConfig,
    Reason,
    Reserve,
    ScoredPolicy,
    Wait,
    WorkingPool,
    decide,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.config import with_queues


def hetero():
    return snapshot(node("t4", "T4", 4), node("a100", "A100", 4), node("asc", "910B", 4))


def reserve(d) -> Reserve:
    assert isinstance(d, Reserve), d
    return d


def heuristic():
    """A config whose queue places with the per-class ``heuristic`` policy (the judgements the
    default keeps for gangs, preemption planning and explanations)."""
    return with_queues(default_config(), QueueConfig(name="t1", placement="heuristic"))


def test_cheapest_fastest_balanced_across_vendors():
    """cheapest picks T4, fastest A100, balanced the best $/capacity (T4 here) for a plain job."""
    snap = hetero()
    assert reserve(decide(job("j", intent=Intent.CHEAPEST), snap)).slices[0].model == "T4"
    assert reserve(decide(job("j", intent=Intent.FASTEST), snap)).slices[0].model == "A100"
    assert reserve(decide(job("j", intent=Intent.BALANCED), snap)).slices[0].model == "T4"


def test_cheapest_sends_heavy_requests_to_strong_classes():
    """With cheapest, a light share goes to T4, a heavy one to the cheapest class that holds it."""
    snap = hetero()
    assert reserve(decide(job("light", memory_mib=4000), snap)).slices[0].model == "T4"
    heavy = reserve(decide(job("heavy", memory_mib=40000), snap))
    assert heavy.slices[0].model == "910B"  # 910B is cheaper than A100 and big enough
    bf16 = reserve(decide(job("bf16", capabilities=["bf16"], min_capacity=0.95), snap))
    assert bf16.slices[0].model == "A100"


def test_cheapest_prices_the_slice_not_the_device():
    """A small share on a big device can be cheaper than a large share of a small device."""
    snap = snapshot(node("t4", "T4", 1), node("a100", "A100", 1))
    # 12 GiB is 80 % of a T4 (0.28 $/h) but 15 % of an A100 (0.45 $/h): T4 still wins.
    assert reserve(decide(job("j", memory_mib=12288), snap)).slices[0].model == "T4"


def test_falls_back_to_next_class_when_cheapest_is_full():
    """When every T4 is taken, a cheapest request takes the next-cheapest class, not a wait."""
    snap = snapshot(node("t4", "T4", 1), node("asc", "910B", 1), leases=(lease("l", ["t4/0"]),))
    assert reserve(decide(job("j"), snap)).slices[0].model == "910B"


def test_binpack_vs_spread_nodes():
    """binpack fills the busier node; spread picks the emptier one."""
    snap = snapshot(node("n1", "A100", 4), node("n2", "A100", 4), leases=(lease("l", ["n1/0"]),))
    cfg = with_queues(
        default_config(),
        QueueConfig(name="pack", placement="binpack"),
        QueueConfig(name="spread", placement="spread"),
    )
    assert reserve(decide(job("a", queue="pack", tenant="x"), snap, cfg)).slices[0].node_id == "n1"
    assert (
        reserve(decide(job("b", queue="spread", tenant="x"), snap, cfg)).slices[0].node_id == "n2"
    )


def test_heuristic_shares_stack_on_shared_devices():
    """The heuristic puts a share on an already-shared device, keeping idle devices whole."""
    snap = snapshot(
        node("n1", "A100", 2),
        node("n2", "A100", 2),
        leases=(lease("l", ["n2/1"], share=(20000, 20)),),
    )
    d = reserve(decide(job("j", memory_mib=10000), snap, heuristic()))
    assert d.slices[0].device_id == "n2/1"


def test_heuristic_avoids_hot_devices_for_shares():
    """A share avoids a device whose live utilization is above the hot threshold."""
    hot = node("n1", "A100", 1, util_pct=97.0)
    cool = node("n2", "A100", 1, util_pct=10.0)
    snap = snapshot(
        hot,
        cool,
        leases=(lease("l1", ["n1/0"], share=(1000, 10)), lease("l2", ["n2/0"], share=(1000, 10))),
    )
    assert reserve(decide(job("j", memory_mib=1000), snap, heuristic())).slices[0].node_id == "n2"


def test_degraded_devices_take_no_new_grants():
    """Only healthy devices take new grants; degraded ones are skipped."""
    snap = snapshot(node("n1", "A100", 1, health="degraded"), node("n2", "A100", 1))
    assert reserve(decide(job("j"), snap)).slices[0].node_id == "n2"


def test_xpupool_avoids_stranding_idle_devices_without_cpu():
    """A CPU-heavy job goes where it does not leave idle devices without host CPU."""
    # n1: 4 idle devices and lots of CPU; n2: 2 idle devices, the same CPU.
    n1 = node("n1", "A100", 4, cpu=32000)
    n2 = node("n2", "A100", 2, cpu=32000)
    snap = snapshot(n1, n2)
    d = reserve(decide(job("j", cpu_milli=24000), snap))
    assert d.slices[0].node_id == "n2"


def test_same_node_gang_is_on_one_node():
    """A same-node gang takes all its devices from one node."""
    snap = snapshot(node("n1", "A100", 4), node("n2", "A100", 8))
    d = reserve(decide(job("g", count=6, gang=GangSpec(same_node=True)), snap))
    assert {s.node_id for s in d.slices} == {"n2"} and len(d.slices) == 6


def test_same_domain_gang_across_nodes():
    """A same-domain gang spans nodes of one interconnect domain, never two domains."""
    snap = snapshot(
        node("a1", "910B", 8, domain="hccs-A"),
        node("a2", "910B", 8, domain="hccs-A"),
        node("b1", "910B", 8, domain="hccs-B"),
        leases=(lease("l", ["b1/0"]),),
    )
    d = reserve(decide(job("g", count=16, gang=GangSpec(same_node=False, same_domain=True)), snap))
    assert {s.node_id for s in d.slices} == {"a1", "a2"}
    assert len({s.device_id for s in d.slices}) == 16


def test_gang_waits_all_or_nothing():
    """A gang that fits only partly waits with waiting_for_gang and reserves nothing."""
    snap = snapshot(
        node("n1", "A100", 4),
        node("n2", "A100", 4),
        leases=(lease("l1", ["n1/0"]), lease("l2", ["n2/0"])),
    )
    pool = WorkingPool(snap, default_config())
    before = (list(pool.dev_mem_free), list(pool.dev_holders))
    d = decide(job("g", count=4, gang=GangSpec(same_node=True)), pool, apply=True)
    assert isinstance(d, Wait) and d.reason is Reason.WAITING_FOR_GANG
    assert (pool.dev_mem_free, pool.dev_holders) == before


def test_any_scope_prefers_fewest_nodes():
    """A multi-device request without a gang still lands on one node when one can hold it."""
    snap = snapshot(node("n1", "A100", 2), node("n2", "A100", 4))
    d = reserve(decide(job("j", count=3), snap))
    assert {s.node_id for s in d.slices} == {"n2"}


def test_host_demand_charged_per_node():
    """Host demand is reserved on the node that carries the devices."""
    snap = snapshot(node("n1", "A100", 2, cpu=8000))
    d = reserve(decide(job("j", cpu_milli=3000, host_memory_mib=1024), snap))
    assert d.host == (HostCharge("n1", 3000, 1024),)
    snap = snapshot(
        node("n1", "A100", 2, cpu=8000),
        leases=(lease("l", ["n1/0"], host=(HostCharge("n1", 6000, 0),)),),
    )
    assert isinstance(decide(job("j", cpu_milli=3000), snap), Wait)


def test_pluggable_node_scorer_selected_per_queue():
    """A ScoredPolicy registered by name drives node choice for the queues that select it."""
    snap = snapshot(node("n1", "A100", 2), node("n2", "A100", 2), node("n3", "A100", 2))
    pol = ScoredPolicy(
        "prefer-n3", lambda pool, ni, chosen, demand, mem: float(pool.nodes[ni].node_id == "n3")
    )
    reg = default_registry().with_policy(pol)
    cfg = with_queues(default_config(), QueueConfig(name="q", placement="prefer-n3"))
    out = decide_batch(
        [PendingRequest(job("j", tenant="x", queue="q"), 0.0)], snap, cfg, policies=reg
    )
    assert reserve(out[0][1]).slices[0].node_id == "n3"


def test_fragmentation_best_fit_keeps_big_holes():
    """The heuristic packs shares best-fit so a large free hole stays for a large share."""
    snap = snapshot(
        node("n1", "A100", 2),
        leases=(lease("l1", ["n1/0"], share=(60000, 0)), lease("l2", ["n1/1"], share=(20000, 0))),
    )
    d = reserve(decide(job("small", memory_mib=15000), snap, heuristic()))
    assert d.slices[0].device_id == "n1/0"  # 21 GiB hole, not the 61 GiB one
    pool = WorkingPool(snap, heuristic())
    decide(job("small", memory_mib=15000), pool, apply=True)
    assert isinstance(decide(job("big", memory_mib=50000), pool), Reserve)


def test_spread_policy_shares_use_emptiest_device():
    """spread puts a share on the device with the most room left."""
    snap = snapshot(node("n1", "A100", 2), leases=(lease("l1", ["n1/0"], share=(20000, 0)),))
    cfg = with_queues(default_config(), QueueConfig(name="t1", placement="spread"))
    assert reserve(decide(job("j", memory_mib=1000), snap, cfg)).slices[0].device_id == "n1/1"
    cfg2 = with_queues(default_config(), QueueConfig(name="t1", placement="binpack"))
    assert reserve(decide(job("j", memory_mib=1000), snap, cfg2)).slices[0].device_id == "n1/0"


def test_snapshot_not_mutated():
    """decide on a snapshot never mutates it (state in, decisions out)."""
    snap = hetero()
    copy = replace(snap)
    decide_batch([job(f"j{i}") for i in range(5)], snap)
    assert snap == copy


def test_a_draining_node_takes_no_new_placement():
    """A node the autoscaler drains takes no device and no host-only placement, its devices
    healthy as they are; the other node does."""
    draining = replace(node("n1", "A100", 2), draining=True)
    snap = snapshot(draining, node("n2", "A100", 1))
    assert reserve(decide(job("j"), snap)).slices[0].node_id == "n2"
    host = reserve(decide(job("h", count=0, cpu_milli=1000), snap))
    assert [h.node_id for h in host.host] == ["n2"]
    only = snapshot(draining)
    assert not isinstance(decide(job("k"), only), Reserve)
    assert not isinstance(decide(job("h", count=0, cpu_milli=1000), only), Reserve)
