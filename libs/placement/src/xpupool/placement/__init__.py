"""Pure placement library: cluster state, policies, fragmentation metric, trace replay."""

from xpupool.placement.frag import FragEvaluator, Shape, ShapeDistribution
from xpupool.placement.policies import Policy, PolicyContext
from xpupool.placement.registry import BASELINES, DEFAULT_POLICY, POLICIES, make_policy
from xpupool.placement.state import ClusterState, NodeSpec, Placement, PodDemand

__all__ = [
    "BASELINES",
    "DEFAULT_POLICY",
    "POLICIES",
    "ClusterState",
    "FragEvaluator",
    "NodeSpec",
    "Placement",
    "PodDemand",
    "Policy",
    "PolicyContext",
    "Shape",
    "ShapeDistribution",
    "make_policy",
]
