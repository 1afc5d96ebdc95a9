"""Property tests over random pools and request streams (hypothesis)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from domain_builders import CATALOG, device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpupool.contracts.payloads import (
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    HostDemand,
    Intent,
    Isolation,
    JobRequested,
)
from xpupool.placement.default import DefaultPolicy, default_registry
from xpupool.placement.inventory import HARD_ISOLATION
from xpupool.placement.pool import domain_key
from xpupool.scheduler.domain import (
    LeaseSlice,
    LeaseState,
    NodeState,
    PendingRequest,
    PoolSnapshot,
    Preempt,
    QueueConfig,
    Reason,
    Reject,
    Reserve,
    SchedulerConfig,
    TimedOut,
    Wait,
    WorkingPool,
    apply_decision,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.config import with_queues

NOW = 100_000.0
MODELS = sorted(CATALOG)
TENANTS = ["ta", "tb", "tc", "td"]


@st.composite
def pools(draw: st.DrawFn) -> PoolSnapshot:
    """1-6 nodes of 1-8 devices, random models, one or two domains per node, health; random
    leases already held."""
    nodes = []
    for n in range(draw(st.integers(1, 6))):
        nid = f"n{n}"
        model = draw(st.sampled_from(MODELS))
        dom = draw(st.sampled_from(["", "d1", "d2"]))
        # Some nodes hold two interconnect domains (devices from ``split`` on are in the other).
        split = draw(st.integers(1, 8))
        devs = tuple(
            device(
                nid,
                i,
                model,
                domain=dom if i < split else f"{nid}-upper",
                health=draw(st.sampled_from(["healthy"] * 6 + ["degraded", "unhealthy"])),
                util_pct=draw(st.none() | st.floats(0, 100)),
            )
            for i in range(draw(st.integers(1, 8)))
        )
        cpu = draw(st.sampled_from([8000, 32000, 64000]))
        nodes.append(NodeState(nid, devs, cpu, cpu, 256000, 256000))
    # Existing leases, built so the ledger counters stay consistent.
    by_id = {d.device_id: d for nd in nodes for d in nd.devices}
    leases = []
    for k in range(draw(st.integers(0, 12))):
        did = draw(st.sampled_from(sorted(by_id)))
        d = by_id[did]
        whole = draw(st.booleans())
        if whole:
            if d.holders:
                continue
            by_id[did] = replace(
                d, memory_free_mib=0, compute_free_pct=0, exclusive=True, holders=1
            )
            sl = LeaseSlice(did, d.memory_total_mib, 100, True)
        else:
            mem = draw(st.integers(1, d.memory_total_mib))
            comp = draw(st.integers(0, 100))
            if d.exclusive or mem > d.memory_free_mib or comp > d.compute_free_pct:
                continue
            by_id[did] = replace(
                d,
                memory_free_mib=d.memory_free_mib - mem,
                compute_free_pct=d.compute_free_pct - comp,
                holders=d.holders + 1,
            )
            sl = LeaseSlice(did, mem, comp, False)
        t = draw(st.sampled_from(TENANTS))
        leases.append(
            LeaseState(
                lease_id=f"l{k}",
                job_id=f"old{k}",
                tenant=t,
                queue=t,
                priority=draw(st.sampled_from([100, 500, 900])),
                started_at_s=draw(st.floats(0, NOW)),
                slices=(sl,),
                preemptible=draw(st.booleans()),
                terminating=draw(st.booleans()) and k % 3 == 0,
            )
        )
    nodes = [replace(nd, devices=tuple(by_id[d.device_id] for d in nd.devices)) for nd in nodes]
    return PoolSnapshot(nodes=tuple(nodes), leases=tuple(leases), now_s=NOW)


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    """Per-tenant queues with random guarantees, limits and borrowing."""
    qs = []
    for t in TENANTS:
        g = draw(st.sampled_from([0.0, 1.0, 3.0]))
        lim = draw(st.sampled_from([None, 2.0, 6.0]))
        qs.append(
            QueueConfig(
                name=t,
                weight=draw(st.sampled_from([1.0, 2.0])),
                guaranteed_units=g,
                limit_units=None if lim is None else max(lim, g),
                over_quota=draw(st.booleans()),
                placement=draw(
                    st.sampled_from([None, "heuristic", "binpack", "spread", "xpupool"])
                ),
            )
        )
    return with_queues(default_config(), *qs)


@st.composite
def requests(draw: st.DrawFn, i: int) -> PendingRequest:
    """A random request: count, whole or share, gang, selectors, intent, priority, host."""
    kind = draw(st.sampled_from(["whole", "mem", "pct", "compute"]))
    dd = {
        "whole": DeviceDemand(),
        "mem": DeviceDemand(memory_mib=draw(st.integers(1, 90000))),
        "pct": DeviceDemand(
            memory_pct=draw(st.integers(1, 100)), compute_pct=draw(st.none() | st.integers(1, 100))
        ),
        "compute": DeviceDemand(compute_pct=draw(st.integers(1, 100))),
    }[kind]
    gang = draw(st.none() | st.builds(GangSpec, same_node=st.booleans(), same_domain=st.booleans()))
    sel = DeviceSelector(
        models=draw(st.sampled_from([[], ["T4"], ["A100", "910B"]])),
        isolation=draw(st.sampled_from([Isolation.ANY, Isolation.HARD])),
        capabilities=draw(st.sampled_from([[], ["bf16"]])),
    )
    r = JobRequested(
        job_id=f"j{i}",
        tenant=draw(st.sampled_from(TENANTS)),
        count=draw(st.integers(1, 5)),
        device=dd,
        selector=sel,
        gang=gang,
        intent=draw(st.sampled_from(list(Intent))),
        priority=draw(st.sampled_from(["low", "normal", "high", "critical"])),
        host=HostDemand(cpu_milli=draw(st.sampled_from([0, 2000, 16000]))),
        max_wait_s=draw(st.none() | st.floats(1, 1000)),
    )
    return PendingRequest(r, NOW - draw(st.floats(0, 2000)))


@st.composite
def streams(draw: st.DrawFn) -> list[PendingRequest]:
    return [draw(requests(i)) for i in range(draw(st.integers(1, 20)))]


def _check_slices(snap: PoolSnapshot, req: JobRequested, r: Reserve) -> None:
    devs = {d.device_id: d for n in snap.nodes for d in n.devices}
    assert len(r.slices) == req.count, "gangs and multi-device requests are never partial"
    assert len({s.device_id for s in r.slices}) == req.count
    for s in r.slices:
        d = devs[s.device_id]
        assert d.health == "healthy"
        hard_share = req.selector.isolation is Isolation.HARD and not req.device.is_whole
        if hard_share:
            # Share limits are not hard: a hard share is a whole hardware partition.
            assert s.whole and d.partition and s.memory_mib >= (req.device.memory_mib or 0)
        else:
            assert s.whole == req.device.is_whole
        assert s.enforced or not (s.whole or hard_share), "whole and hard slices hold their limits"
        if req.selector.models:
            assert d.model.lower() in {m.lower() for m in req.selector.models}
        if hard_share:
            assert d.isolation & HARD_ISOLATION, "hard isolation only on MIG/vNPU"
    if req.gang is not None and req.count > 1:
        if req.gang.same_node:
            assert len({s.node_id for s in r.slices}) == 1
        elif req.gang.same_domain:
            assert len({domain_key(devs[s.device_id].domain, s.node_id) for s in r.slices}) == 1


@pytest.mark.parametrize("learned", [False, True], ids=["classic", "learned-default"])
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=pools(), cfg=configs(), stream=streams())
def test_batch_invariants(
    learned: bool, snap: PoolSnapshot, cfg: SchedulerConfig, stream: list[PendingRequest]
) -> None:
    """Capacity and quota limits are never exceeded, every request gets exactly one valid outcome,
    and no gang is ever partly placed: under the domain's classic policies and under the
    scheduler's learned default (as the service wires it)."""
    registry = default_registry(cfg.placement)
    if learned:
        registry = DefaultPolicy.create(cfg.placement).cycle_registry(cfg.placement)
    out = decide_batch(stream, snap, cfg, policies=registry)
    assert sorted(j for j, _ in out) == sorted(p.request.job_id for p in stream)

    replay = WorkingPool(snap, cfg)
    start_units = {q: u.units for q, u in replay.usage.items()}
    by_job = {p.request.job_id: p.request for p in stream}
    live = {ls.lease_id: ls for ls in snap.leases}
    for job_id, d in out:
        req = by_job[job_id]
        if isinstance(d, Wait):
            assert isinstance(d.reason, Reason) and d.reason.value and d.detail
        elif isinstance(d, Reject):
            assert isinstance(d.reason, Reason) and d.detail
        elif isinstance(d, TimedOut):
            assert req.max_wait_s is not None
        else:
            assert isinstance(d, Reserve | Preempt)
            if isinstance(d, Preempt):
                assert d.victims
                for v in d.victims:
                    ls = live.pop(v)  # each victim exists and is preempted once
                    assert ls.preemptible and not ls.terminating
            _check_slices(snap, req, d.reserve if isinstance(d, Preempt) else d)
            apply_decision(replay, d)
            assert not replay.violations(), replay.violations()
    for q, u in replay.usage.items():
        qc = cfg.queue(q)
        if qc is not None and qc.limit_units is not None:
            assert u.units <= max(qc.limit_units, start_units.get(q, 0.0)) + 1e-6, q


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=pools(), stream=streams())
def test_decisions_are_deterministic(snap: PoolSnapshot, stream: list[PendingRequest]) -> None:
    """The same snapshot and requests give the same decisions (replayable), in any input order."""
    a = decide_batch(stream, snap)
    b = decide_batch(list(reversed(stream)), snap)
    assert a == b
