"""Pure placement library: cluster state, policies, the fragmentation metric, workload files.

It imports no service and does no I/O beyond reading a workload file; the trace replay that
measures its policies is ``xpupool.replay`` (the top-level package), which depends on it.
"""

from xpupool.placement.frag import FragEvaluator, Shape, ShapeDistribution
from xpupool.placement.policies import Policy, PolicyContext
from xpupool.placement.registry import BASELINES, DEFAULT_POLICY, POLICIES, make_policy
from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand

__all__ = [
    "BASELINES",
    "DEFAULT_POLICY",
    "POLICIES",
    "ClusterState",
    "FragEvaluator",
    "NodeSpec",
    "NodeChoice",
    "PodDemand",
    "Policy",
    "PolicyContext",
    "Shape",
    "ShapeDistribution",
    "make_policy",
]
