"""Registry of placement policies by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final

from xpupool.placement.online import OnlineFragmentationPolicy
from xpupool.placement.ours import FragmentationPolicy
from xpupool.placement.policies import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProdPolicy,
    FGDPolicy,
    FirstFitPolicy,
    PackingPolicy,
    Policy,
    PolicyContext,
    RandomPolicy,
)

PolicyFactory = Callable[[PolicyContext], Policy]

#: Name -> factory. Read-only: register new policies in code, not at run time.
POLICIES: Final[Mapping[str, PolicyFactory]] = MappingProxyType(
    {
        "random": lambda ctx: RandomPolicy(ctx.rng),
        "dotprod": lambda ctx: DotProdPolicy(),
        "clustering": lambda ctx: ClusteringPolicy(),
        "packing": lambda ctx: PackingPolicy(),
        "bestfit": lambda ctx: BestFitPolicy(),
        "fgd": lambda ctx: FGDPolicy(ctx.typical_shapes()),
        "xpupool-static": lambda ctx: FragmentationPolicy.from_context(ctx),
        "xpupool-online": lambda ctx: OnlineFragmentationPolicy(),
        # Not a published baseline: what node-name order alone is worth.
        "firstfit": lambda ctx: FirstFitPolicy(),
    }
)

#: The policy the scheduler uses unless told otherwise.
DEFAULT_POLICY: Final = "xpupool-online"

#: The published baselines, in the paper's order.
BASELINES: Final = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd")


def make_policy(name: str, ctx: PolicyContext | None = None) -> Policy:
    """Instantiate policy ``name`` (case-insensitive) with ``ctx`` (a default one if None)."""
    key = name.strip().lower()
    if key not in POLICIES:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[key](ctx if ctx is not None else PolicyContext())
