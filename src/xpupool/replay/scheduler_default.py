"""The scheduler's own decisions on a trace's arrival sequence, for the replay's scoring.

Each pod becomes a job request (``xpupool.replay.requests.job_request``) decided by the
domain's ``decide`` against a working pool of the trace's nodes, with the registry the service
builds (the learned default in place of the classic ``xpupool``), one call per pod as a cycle
with one new request makes it. The outcomes feed ``RecordedPolicy`` so the replay scores them
(and re-validates every placement) exactly as it scores its own policies.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from xpupool.placement import NodeSpec, PodDemand
from xpupool.placement.default import DefaultPolicy
from xpupool.placement.inventory import DeviceState, NodeState, PoolSnapshot
from xpupool.replay.arrivals import Outcome
from xpupool.replay.requests import job_request
from xpupool.scheduler.domain import (
    PolicyRegistry,
    Reserve,
    WorkingPool,
    decide,
    default_config,
)
from xpupool.scheduler.settings import SchedulerSettings

__all__ = ["decide_arrivals"]


def trace_snapshot(
    nodes: Sequence[NodeSpec],
    model_names: Mapping[str, str] | None = None,
    memory_mib: int = 16_000,
) -> PoolSnapshot:
    """A fresh pool of the trace's nodes as the domain sees it: one NVIDIA device per GPU, the
    model renamed through ``model_names``. The trace gives no device memory, so every device has
    ``memory_mib`` (shares in the trace are compute shares)."""
    names = model_names or {}
    return PoolSnapshot(
        nodes=tuple(
            NodeState(
                n.name,
                tuple(
                    DeviceState(
                        f"{n.name}/nvidia{k}",
                        n.name,
                        "nvidia",
                        names.get(n.model, n.model),
                        memory_mib,
                        memory_mib,
                        index=k,
                    )
                    for k in range(n.num_gpu)
                ),
                n.cpu_milli,
                n.cpu_milli,
                n.memory_mib,
                n.memory_mib,
            )
            for n in nodes
        )
    )


def decide_arrivals(
    nodes: Sequence[NodeSpec],
    workload: Sequence[PodDemand],
    registry: PolicyRegistry | None = None,
) -> tuple[list[Outcome], list[float]]:
    """Every pod's outcome (node row and GPU slots, or None) and each decision's seconds."""
    config = default_config()
    # As the service builds it (scheduler.main): one learned default for the whole run.
    default = DefaultPolicy.create(half_life=SchedulerSettings().placement_shape_half_life)
    policies = registry or default.cycle_registry(config.placement)
    pool = WorkingPool(trace_snapshot(nodes), config)
    row = {n.name: i for i, n in enumerate(nodes)}
    outcomes: list[Outcome] = []
    times: list[float] = []
    for i, pod in enumerate(workload):
        started = time.perf_counter()
        decision = decide(job_request(f"j{i}", pod), pool, config, policies=policies, apply=True)
        times.append(time.perf_counter() - started)
        if isinstance(decision, Reserve):
            node = decision.host[0].node_id if decision.host else decision.slices[0].node_id
            outcomes.append((row[node], tuple(sorted(s.index for s in decision.slices))))
        else:
            outcomes.append(None)
    violations = pool.violations()
    if violations:
        raise AssertionError(f"the working pool went over capacity: {violations[:3]}")
    return outcomes, times
