"""Small builders for scheduler-domain tests: a catalog, nodes, snapshots with leases, requests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from xpupool.contracts.payloads import (
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    HostDemand,
    Intent,
    JobRequested,
)
from xpupool.scheduler.domain import (
    DeviceState,
    HostCharge,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)

# Illustrative catalog: memory is visible MiB, capacity in A100-equivalents, cost in $/h.
CATALOG: dict[str, dict[str, Any]] = {
    "T4": dict(
        vendor="nvidia",
        memory_total_mib=15360,
        capacity_units=0.25,
        cost_per_hour=0.35,
        capabilities=frozenset({"fp16"}),
        isolation=frozenset({"hami-core"}),
        interconnect="pcie",
    ),
    "A100": dict(
        vendor="nvidia",
        memory_total_mib=81920,
        capacity_units=1.0,
        cost_per_hour=3.0,
        capabilities=frozenset({"fp16", "bf16"}),
        isolation=frozenset({"hami-core"}),
        interconnect="nvlink",
    ),
    "A100-MIG-3g.40gb": dict(
        vendor="nvidia",
        memory_total_mib=40192,
        capacity_units=0.43,
        cost_per_hour=1.3,
        capabilities=frozenset({"fp16", "bf16"}),
        isolation=frozenset({"mig"}),
        interconnect="nvlink",
        partition="mig",
    ),
    "910B": dict(
        vendor="ascend",
        memory_total_mib=65536,
        capacity_units=0.9,
        cost_per_hour=1.6,
        capabilities=frozenset({"fp16", "bf16"}),
        isolation=frozenset({"vnpu"}),
        interconnect="hccs",
    ),
    "MLU370": dict(
        vendor="cambricon",
        memory_total_mib=23308,
        capacity_units=0.3,
        cost_per_hour=0.6,
        capabilities=frozenset({"fp16", "bf16"}),
        isolation=frozenset(),
        interconnect="mlu-link",
    ),
}


def device(node_id: str, index: int, model: str = "A100", **kw: Any) -> DeviceState:
    """A free device of ``model`` on ``node_id``; keyword args override any field."""
    spec = dict(CATALOG[model])
    spec.update(kw)
    spec.setdefault("memory_free_mib", spec["memory_total_mib"])
    return DeviceState(
        device_id=f"{node_id}/{index}",
        node_id=node_id,
        model=model,
        index=index,
        uuid=f"uuid-{node_id}-{index}",
        **spec,
    )


def node(
    node_id: str,
    model: str = "A100",
    n: int = 8,
    *,
    cpu: int = 64000,
    mem: int = 512000,
    domain: str = "",
    **dev_kw: Any,
) -> NodeState:
    """A node with ``n`` identical free devices."""
    devs = tuple(device(node_id, i, model, domain=domain, **dev_kw) for i in range(n))
    return NodeState(
        node_id=node_id,
        devices=devs,
        cpu_milli_total=cpu,
        cpu_milli_free=cpu,
        memory_mib_total=mem,
        memory_mib_free=mem,
    )


def lease(
    lease_id: str,
    devices: list[str],
    *,
    tenant: str = "t1",
    queue: str = "t1",
    priority: int = 500,
    started: float = 0.0,
    share: tuple[int, int] | None = None,
    preemptible: bool = True,
    host: tuple[HostCharge, ...] = (),
    terminating: bool = False,
    preempted_for: str = "",
) -> LeaseState:
    """A lease on whole ``devices`` (or a (memory_mib, compute_pct) ``share`` of each)."""
    slices = tuple(
        LeaseSlice(d, share[0], share[1], False) if share else LeaseSlice(d, 0, 100, True)
        for d in devices
    )
    return LeaseState(
        lease_id=lease_id,
        job_id=f"job-{lease_id}",
        tenant=tenant,
        queue=queue,
        priority=priority,
        started_at_s=started,
        slices=slices,
        preemptible=preemptible,
        host=host,
        terminating=terminating,
        preempted_for=preempted_for,
    )


def snapshot(
    *nodes: NodeState, leases: tuple[LeaseState, ...] = (), now: float = 10_000.0
) -> PoolSnapshot:
    """A snapshot whose device and host counters already include ``leases``, as the ledger's do."""
    by_id = {d.device_id: d for n in nodes for d in n.devices}
    host_cpu: dict[str, int] = {}
    host_mem: dict[str, int] = {}
    for ls in leases:
        for s in ls.slices:
            d = by_id[s.device_id]
            if s.whole:
                d = replace(d, memory_free_mib=0, compute_free_pct=0, exclusive=True, holders=1)
            else:
                d = replace(
                    d,
                    memory_free_mib=d.memory_free_mib - s.memory_mib,
                    compute_free_pct=d.compute_free_pct - s.compute_pct,
                    holders=d.holders + 1,
                )
            by_id[s.device_id] = d
        for h in ls.host:
            host_cpu[h.node_id] = host_cpu.get(h.node_id, 0) + h.cpu_milli
            host_mem[h.node_id] = host_mem.get(h.node_id, 0) + h.memory_mib
    out = tuple(
        replace(
            n,
            devices=tuple(by_id[d.device_id] for d in n.devices),
            cpu_milli_free=n.cpu_milli_free - host_cpu.get(n.node_id, 0),
            memory_mib_free=n.memory_mib_free - host_mem.get(n.node_id, 0),
        )
        for n in nodes
    )
    return PoolSnapshot(nodes=out, leases=leases, now_s=now)


def job(
    job_id: str,
    *,
    tenant: str = "t1",
    count: int = 1,
    memory_mib: int | None = None,
    memory_pct: int | None = None,
    compute_pct: int | None = None,
    gang: GangSpec | None = None,
    intent: Intent = Intent.CHEAPEST,
    priority: str = "normal",
    queue: str | None = None,
    cpu_milli: int = 0,
    host_memory_mib: int = 0,
    max_wait_s: float | None = None,
    expected_duration_s: float | None = None,
    **selector: Any,
) -> JobRequested:
    """A request; extra keyword args go to the DeviceSelector."""
    return JobRequested(
        job_id=job_id,
        tenant=tenant,
        count=count,
        device=DeviceDemand(memory_mib=memory_mib, memory_pct=memory_pct, compute_pct=compute_pct),
        selector=DeviceSelector(**selector),
        host=HostDemand(cpu_milli=cpu_milli, memory_mib=host_memory_mib),
        gang=gang,
        intent=intent,
        priority=priority,
        queue=queue,
        max_wait_s=max_wait_s,
        expected_duration_s=expected_duration_s,
    )
