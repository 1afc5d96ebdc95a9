"""Host-only requests (``count: 0``): validation, placement on one node, quotas, waiting."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from domain_builders import job, lease, node, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpupool.contracts.payloads import GangSpec, JobRequested, Vendor
from xpupool.placement.default import default_registry
from xpupool.placement.demand import make_demand
from xpupool.placement.engine import HOST_ONLY, place_host_only
from xpupool.scheduler.domain import (
    HostCharge,
    NodeState,
    PendingRequest,
    PoolSnapshot,
    Preempt,
    QueueConfig,
    Reason,
    Reject,
    Reserve,
    Wait,
    WorkingPool,
    apply_decision,
    decide,
    decide_batch,
    default_config,
    never_fits,
)
from xpupool.scheduler.domain.config import StarvationConfig, with_queues
from xpupool.scheduler.domain.quota import mark_over_quota

NOW = 10_000.0


def host_job(job_id: str = "h", cpu: int = 4000, mem: int = 8192, **kw: Any) -> JobRequested:
    """A host-only request (count 0) for ``cpu`` mCPU and ``mem`` MiB."""
    return job(job_id, count=0, cpu_milli=cpu, host_memory_mib=mem, **kw)


def reserved_node(d: object) -> str:
    assert isinstance(d, Reserve), d
    assert d.slices == () and d.capacity_units == 0.0
    assert len(d.host) == 1
    return d.host[0].node_id


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"memory_mib": 1024}, "device.memory_mib"),
        ({"memory_pct": 10}, "device.memory_pct"),
        ({"compute_pct": 10}, "device.compute_pct"),
        ({"gang": GangSpec()}, "gang"),
        ({"vendor": Vendor.NVIDIA}, "selector.vendor"),
        ({"models": ["A100"]}, "selector.models"),
    ],
)
def test_host_only_request_with_a_device_part_is_rejected_naming_the_field(
    extra: dict[str, object], field: str
) -> None:
    """A count-0 request takes no device: a share, a gang or a selector is an invalid input."""
    snap = snapshot(node("n1"))
    rej = never_fits(host_job(**extra), snap)
    assert rej is not None and (rej.reason, rej.field) == (Reason.INVALID_REQUEST, field)
    d = decide(host_job(**extra), snap)
    assert isinstance(d, Reject) and d.field == field


def test_host_only_request_must_ask_for_host_resources() -> None:
    """count 0 without CPU or host memory asks for nothing: rejected, naming ``host``."""
    d = decide(job("nothing", count=0), snapshot(node("n1")))
    assert isinstance(d, Reject)
    assert (d.reason, d.field) == (Reason.INVALID_REQUEST, "host")
    assert never_fits(host_job(cpu=0, mem=1), snapshot(node("n1"))) is None
    assert never_fits(host_job(cpu=1, mem=0), snapshot(node("n1"))) is None


def test_host_only_request_larger_than_every_node_is_rejected() -> None:
    """No node could ever host the CPU (or the memory): rejected at once, naming the field."""
    snap = snapshot(node("n1", cpu=8000, mem=1000), node("n2", cpu=4000, mem=64000))
    cpu = decide(host_job(cpu=9000, mem=10), snap)
    assert isinstance(cpu, Reject)
    assert (cpu.reason, cpu.field) == (Reason.EXCEEDS_NODE_CAPACITY, "host.cpu_milli")
    mem = decide(host_job(cpu=5000, mem=2000), snap)
    assert isinstance(mem, Reject)
    assert (mem.reason, mem.field) == (Reason.EXCEEDS_NODE_CAPACITY, "host.memory_mib")
    # Each fits some node on its own; together they fit none.
    assert never_fits(host_job(cpu=8000, mem=1000), snap) is None


def test_host_only_goes_where_no_idle_device_is_stranded() -> None:
    """The charge goes to a node whose devices are all busy, not to one with idle devices."""
    nodes = (node("idle", n=2), node("busy", n=2), node("idle2", n=2))
    snap = snapshot(*nodes, leases=(lease("l1", ["busy/0", "busy/1"]),))
    assert reserved_node(decide(host_job(), snap)) == "busy"


def test_host_only_prefers_a_node_without_devices_then_the_most_cpu_per_idle_device() -> None:
    """Device-less nodes strand nothing; between idle nodes, the most CPU left per idle device."""
    cpu_only = NodeState("cpu-only", (), 16000, 16000, 64000, 64000)
    many = node("many", n=8, cpu=64000)  # 60 000 left over 8 idle devices: 7 500 each
    few = node("few", n=2, cpu=32000)  # 28 000 left over 2 idle devices: 14 000 each
    assert reserved_node(decide(host_job(), snapshot(many, few, cpu_only))) == "cpu-only"
    assert reserved_node(decide(host_job(), snapshot(many, few))) == "few"


def test_host_only_ties_go_to_the_first_node() -> None:
    """Equal nodes: the first in pool order wins, deterministically."""
    snap = snapshot(node("a", n=2), node("b", n=2), node("c", n=2))
    assert reserved_node(decide(host_job(), snap)) == "a"


def test_host_only_never_over_commits_cpu_or_memory() -> None:
    """A batch of host-only jobs takes what the nodes' free CPU allows and the rest waits."""
    snap = snapshot(node("n1", n=1, cpu=8000), node("n2", n=1, cpu=7000))
    out = decide_batch([host_job(f"h{i}", cpu=3000, mem=100) for i in range(6)], snap)
    reserved = [d for _, d in out if isinstance(d, Reserve)]
    waits = [d for _, d in out if isinstance(d, Wait)]
    assert len(reserved) == 4 and len(waits) == 2
    assert all(w.reason is Reason.INSUFFICIENT_CAPACITY for w in waits)
    by_node: dict[str, int] = {}
    for r in reserved:
        by_node[r.host[0].node_id] = by_node.get(r.host[0].node_id, 0) + r.host[0].cpu_milli
    assert by_node == {"n1": 6000, "n2": 6000}


def test_host_only_pool_counters_stay_consistent() -> None:
    """Reserving host-only jobs one by one on a working pool keeps every counter valid."""
    pool = WorkingPool(snapshot(node("n1", n=2, cpu=10000, mem=10000)), default_config())
    granted = 0
    for i in range(5):
        d = decide(host_job(f"h{i}", cpu=3000, mem=3000), pool, apply=True)
        granted += isinstance(d, Reserve)
        assert pool.violations() == []
    assert granted == 3
    assert pool.node_cpu_free == [1000] and pool.node_mem_free == [1000]
    pool.release("reservation:h0")
    assert pool.node_cpu_free == [4000]


def test_host_only_skips_nodes_that_are_down() -> None:
    """A node whose devices are all lost (the snapshot's mark of a lost node) takes no job."""
    down = node("down", n=2, health="lost")
    assert reserved_node(decide(host_job(), snapshot(down, node("up", n=2)))) == "up"
    d = decide(host_job(), snapshot(down))
    assert isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY


def test_host_only_uses_no_quota() -> None:
    """A queue at its limit (or at its guarantee without borrowing) still runs host-only jobs."""
    cfg = with_queues(
        default_config(),
        QueueConfig("full", limit_units=1.0, guaranteed_units=1.0, over_quota=False),
    )
    snap = snapshot(node("n1", n=2), leases=(lease("l1", ["n1/0"], tenant="full", queue="full"),))
    assert isinstance(decide(job("gpu", tenant="full"), snap, cfg), Wait)
    assert reserved_node(decide(host_job(tenant="full"), snap, cfg)) == "n1"


def test_host_only_leases_are_never_borrowed_capacity() -> None:
    """A host-only lease took no quota, so reclaim never counts it as over-quota."""
    host_lease = lease("hl", [], host=(HostCharge("n1", 1000, 100),))
    snap = snapshot(node("n1", n=1), leases=(host_lease,))
    pool = WorkingPool(snap, default_config())
    assert "hl" not in mark_over_quota(pool, default_config())
    assert pool.leases["hl"].nodes == frozenset({0})


def test_host_only_waits_instead_of_preempting() -> None:
    """A critical host-only job on a full node waits with a reason; it never plans preemption."""
    full = lease("low", ["n1/0"], priority=100, host=(HostCharge("n1", 8000, 0),))
    snap = snapshot(node("n1", n=1, cpu=8000), leases=(full,), now=10_000.0)
    d = decide(host_job(priority="critical", cpu=1000), snap)
    assert not isinstance(d, Preempt)
    assert isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY
    # While that lease is ending, the job is told the capacity is on its way.
    ending = lease("low", ["n1/0"], host=(HostCharge("n1", 8000, 0),), terminating=True)
    d = decide(host_job(cpu=1000), snapshot(node("n1", n=1, cpu=8000), leases=(ending,)))
    assert isinstance(d, Wait) and d.reason is Reason.CAPACITY_INCOMING


def test_host_only_lease_can_be_a_victim_for_cpu() -> None:
    """A GPU job short of host CPU may preempt a lower-priority host-only lease of its queue."""
    cpu_hog = lease("hog", [], priority=100, host=(HostCharge("n1", 7000, 0),))
    snap = snapshot(node("n1", n=1, cpu=8000), leases=(cpu_hog,))
    d = decide(job("gpu", priority="critical", cpu_milli=4000), snap)
    assert isinstance(d, Preempt) and d.victims == ("hog",)
    assert d.reserve.slices[0].device_id == "n1/0"


def test_host_only_times_out_like_any_request() -> None:
    """max_wait_s applies to a waiting host-only request too."""
    from xpupool.scheduler.domain import PendingRequest, TimedOut

    busy = lease("busy", ["n1/0"], host=(HostCharge("n1", 1500, 0),))
    snap = snapshot(node("n1", n=1, cpu=2000), leases=(busy,), now=100.0)
    item = PendingRequest(host_job(cpu=1000, mem=0, max_wait_s=5.0), enqueued_at_s=0.0)
    d = decide(item, snap)
    assert isinstance(d, TimedOut) and d.last_reason is Reason.INSUFFICIENT_CAPACITY


def test_place_host_only_placement_convention() -> None:
    """The engine's host-only placement: no devices, class HOST_ONLY, one host charge."""
    pool = WorkingPool(snapshot(node("n1", n=1), node("n2", n=1)), default_config())
    demand = make_demand(host_job(cpu=500, mem=50), pool)
    assert demand.host_only and demand.classes == ()
    pl = place_host_only(pool, demand, default_registry().get("binpack"))
    assert pl is not None
    assert (pl.class_index, pl.devices, pl.host, pl.policy) == (
        HOST_ONLY,
        (),
        ((0, 500, 50),),
        "binpack",
    )
    pool.held_nodes = {0}
    held = place_host_only(pool, demand, default_registry().get("binpack"))
    assert held is not None and held.host[0][0] == 1
    pool.held_nodes = {0, 1}
    assert place_host_only(pool, demand, default_registry().get("binpack")) is None
    free = place_host_only(pool, demand, default_registry().get("binpack"), respect_holds=False)
    assert free is not None and free.host[0][0] == 0


def test_trace_policy_places_host_only_as_a_cpu_only_pod() -> None:
    """A pool-wide trace policy gets ``place_pool(pool, demand, ())``: any node row but held
    or down ones, no devices (bestfit: the least CPU left over)."""
    from xpupool.placement.node_policies import make_trace_policies

    (policy,) = make_trace_policies(names=["bestfit"])
    snap = snapshot(
        node("roomy", n=1, cpu=64000),
        node("tight", n=1, cpu=8000),
        node("down", n=1, cpu=4000, health="lost"),
    )
    pool = WorkingPool(snap, default_config())
    demand = make_demand(host_job(cpu=4000, mem=100), pool)
    pl = policy.place_pool(pool, demand, ())
    assert pl is not None and (pl.class_index, pl.devices) == (HOST_ONLY, ())
    assert pl.host == ((1, 4000, 100),)
    pool.held_nodes = {1}
    held = policy.place_pool(pool, demand, ())
    assert held is not None and held.host[0][0] == 0
    cfg = with_queues(default_config(), QueueConfig("trace", placement=policy.name))
    registry = default_registry(cfg.placement).with_policy(policy)
    d = decide(host_job(tenant="trace", cpu=4000, mem=100), snap, cfg, policies=registry)
    assert reserved_node(d) == "tight" and isinstance(d, Reserve) and d.policy == policy.name


@st.composite
def host_streams(draw: st.DrawFn) -> tuple[PoolSnapshot, list[JobRequested]]:
    """A few nodes (some busy, some down, one maybe device-less) and host-only and GPU jobs."""
    nodes: list[NodeState] = []
    for n in range(draw(st.integers(1, 5))):
        cpu = draw(st.sampled_from([0, 4000, 8000, 32000]))
        mem = draw(st.sampled_from([0, 1000, 64000]))
        devs = draw(st.integers(0, 4))
        health = draw(st.sampled_from(["healthy"] * 4 + ["lost"]))
        if devs:
            nodes.append(node(f"n{n}", "T4", devs, cpu=cpu, mem=mem, health=health))
        else:
            nodes.append(NodeState(f"n{n}", (), cpu, cpu, mem, mem))
    jobs = [
        host_job(
            f"h{i}",
            cpu=draw(st.sampled_from([0, 500, 3000, 9000])),
            mem=draw(st.sampled_from([0, 100, 5000])),
        )
        if draw(st.booleans())
        else job(f"g{i}", cpu_milli=draw(st.sampled_from([0, 2000])), models=["T4"])
        for i in range(draw(st.integers(1, 12)))
    ]
    return snapshot(*nodes), jobs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(host_streams(), st.sampled_from(["xpupool", "binpack", "spread", "bestfit-trace"]))
def test_host_only_batches_never_over_commit(
    case: tuple[PoolSnapshot, list[JobRequested]], placement: str
) -> None:
    """Whatever the pool and the policy, a batch mixing host-only and GPU jobs never takes more
    host CPU or memory than a node has free, puts host-only jobs on live nodes without devices,
    and answers every job."""
    from xpupool.placement.node_policies import make_trace_policies

    snap, jobs = case
    cfg = with_queues(default_config(), QueueConfig("t1", placement=placement))
    registry = default_registry(cfg.placement)
    for p in make_trace_policies(names=["bestfit"]):
        registry = registry.with_policy(p)
    out = decide_batch(jobs, snap, cfg, policies=registry)
    assert sorted(j for j, _ in out) == sorted(r.job_id for r in jobs)
    replay = WorkingPool(snap, cfg)
    up = {n.node_id for i, n in enumerate(replay.nodes) if replay.node_up[i]}
    for job_id, d in out:
        if isinstance(d, Reserve) and job_id.startswith("h"):
            assert d.slices == () and len(d.host) == 1 and d.host[0].node_id in up
            assert d.capacity_units == 0.0 and d.in_quota
        if isinstance(d, Wait):
            assert d.detail
        apply_decision(replay, d)
        assert replay.violations() == []


def test_a_starved_host_only_request_holds_the_node_closest_to_fitting() -> None:
    """Waiting past starvation.after_s, a host-only request holds the node with the most CPU
    free; later small requests in the batch must leave that node's CPU alone."""
    cfg = replace(default_config(), starvation=StarvationConfig(after_s=60.0, max_holds=1))
    busy = (
        lease("x1", ["n1/0"], host=(HostCharge("n1", 6000, 0),), priority=1000),
        lease("x2", ["n2/0"], host=(HostCharge("n2", 5000, 0),), priority=1000),
    )
    snap = snapshot(
        node("n1", "A100", 1, cpu=8000), node("n2", "A100", 1, cpu=8000), leases=busy, now=NOW
    )
    starved = PendingRequest(host_job("big", cpu=4000, mem=0, priority="high"), NOW - 120)
    smalls = [PendingRequest(host_job(f"s{i}", cpu=1000, mem=0), NOW - 1) for i in range(4)]
    out = dict(decide_batch([starved, *smalls], snap, cfg))
    assert isinstance(out["big"], Wait) and out["big"].reason is Reason.INSUFFICIENT_CAPACITY
    placed = [reserved_node(d) for j, d in out.items() if isinstance(d, Reserve)]
    assert placed and set(placed) == {"n1"}  # n2 (3,000 mCPU free) is held for "big"
    held = [d for j, d in out.items() if j != "big" and isinstance(d, Wait)]
    assert held and all(d.reason is Reason.CAPACITY_RESERVED for d in held)
