"""The trace policies in the scheduler domain place exactly as the in-process replay does."""

from __future__ import annotations

import numpy as np
import pytest

from xpupool.placement import NodeSpec, PodDemand, PolicyContext, ShapeDistribution, make_policy
from xpupool.placement.default import default_registry
from xpupool.placement.node_policies import (
    make_trace_policies,
    parse_aliases,
    trace_policy_name,
)
from xpupool.replay.arrivals import build_fgd_workload, replay_arrivals
from xpupool.replay.requests import job_request
from xpupool.replay.scheduler_default import trace_snapshot
from xpupool.scheduler.domain import (
    Reserve,
    WorkingPool,
    decide,
    parse_config,
)
from xpupool.scheduler.domain.config import BUILTIN_POLICIES

MODELS = {"P100": "P100-PCIE-16GB", "V100M16": "V100-SXM2-16GB", "T4": "T4"}


def _cluster() -> list[NodeSpec]:
    shapes = [
        ("P100", 2, 64_000),
        ("V100M16", 8, 96_000),
        ("T4", 1, 32_000),
        ("V100M16", 4, 64_000),
    ]
    # Names deliberately out of list order: ties must go to the first name, not the first row.
    return [
        NodeSpec(f"node-{(i * 7) % 16:02d}", cpu, 256 * 1024, gpus, model)
        for i, (model, gpus, cpu) in enumerate(shapes * 4)
    ]


def _pods(n: int, seed: int) -> list[PodDemand]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = rng.integers(4)
        spec = frozenset({"V100M16", "P100"}) if rng.random() < 0.2 else None
        cpu = int(rng.choice([2_000, 4_000, 8_000, 16_000]))
        if kind == 0:
            out.append(PodDemand(cpu, 4096, 0, 0, None, f"p{i}"))
        elif kind == 1:
            out.append(PodDemand(cpu, 4096, 1, int(rng.integers(1, 100)) * 10, spec, f"p{i}"))
        elif kind == 2:
            out.append(PodDemand(cpu, 8192, 1, 1000, spec, f"p{i}"))
        else:
            out.append(PodDemand(cpu, 8192, int(rng.choice([2, 4, 8])), 1000, spec, f"p{i}"))
    return out


@pytest.mark.parametrize("policy", ["xpupool-static", "fgd", "bestfit", "clustering", "packing"])
def test_trace_policy_decides_as_the_replay(policy: str) -> None:
    nodes = _cluster()
    original = _pods(300, 7)
    workload = build_fgd_workload(original, 3, sum(n.num_gpu for n in nodes) * 1000)
    assert any(p.is_cpu_only for p in workload)  # CPU-only pods are host-only requests
    typical = ShapeDistribution.typical(original)
    ctx = PolicyContext(rng=np.random.default_rng(3), workload=original, typical=typical)
    ref = replay_arrivals(
        nodes, workload, make_policy(policy, ctx), typical, record_placements=True
    )

    name = trace_policy_name(policy)
    cfg = parse_config(
        {"queues": [{"name": "replay", "placement": name}]},
        known_policies=(*BUILTIN_POLICIES, name),
    )
    aliases = parse_aliases(",".join(f"{v}={k}" for k, v in MODELS.items()))
    registry = default_registry(cfg.placement)
    for p in make_trace_policies(original, aliases, 3, [policy]):
        registry = registry.with_policy(p)
    pool = WorkingPool(trace_snapshot(nodes, MODELS), cfg)
    live = []
    for i, pod in enumerate(workload):
        d = decide(job_request(f"j{i}", pod, MODELS), pool, cfg, policies=registry, apply=True)
        if isinstance(d, Reserve):
            assert d.policy == name
            node_id = d.slices[0].node_id if d.slices else d.host[0].node_id
            live.append((node_id, tuple(sorted(s.index for s in d.slices))))
    assert live == [(r.node, tuple(sorted(r.gpus))) for r in ref.placements]
    assert pool.violations() == []


def test_parse_aliases_names_the_bad_item() -> None:
    assert parse_aliases(" A=B , C=D ") == {"A": "B", "C": "D"}
    with pytest.raises(ValueError, match="bad model alias"):
        parse_aliases("A")
