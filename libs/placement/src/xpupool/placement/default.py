"""The scheduler's default placement policy, ``xpupool``: fragmentation-aware, shapes learned live.

It is the trace-validated policy of ``xpupool.placement`` (``ours.FragmentationPolicy``:
fragmentation descent against the distribution of request shapes, stranded-GPU pricing, explicit
packing), placing on the pool's per-node view (:mod:`~xpupool.placement.node_policies`), with
the shape distribution learned from the request stream
(:class:`~xpupool.placement.online.OnlineFragmentationPolicy`) instead of read from a workload file.

How it merges with the rest of the scheduler:

* **Learning**: :func:`~xpupool.scheduler.domain.decide.decide_batch` shows it every valid request
  (:meth:`DefaultPolicy.observe`, idempotent per job id), whatever queue the request is in: the
  fragments that matter are those of the whole pool's workload. On its first decision a fresh
  replica also counts the live leases, so a restart does not start from nothing.
* **Intent first, fragmentation second**: the request's intent (cheapest / fastest / balanced)
  orders the quota-allowed device classes as it always has (``class_cost_key``). Classes the
  intent ranks equally (same price and capacity, or not in the catalog) form one tier, and the
  fragmentation score chooses across every node of the tier; a lower tier is tried only when
  nothing in the higher one fits. So light work still goes to cheap cards, and within what the
  user is indifferent about, the pool stays unfragmented.
* **Topology**: one-node placements (one device, or a gang on one node) are fragmentation-scored
  on the per-node view, whose feasibility is the pool's own. A gang within one interconnect
  domain, and a gang allowed across nodes that no single node holds, are placed by the engine's
  gang term (:func:`~xpupool.placement.engine.place_in_class`: fewest nodes, then the tightest
  domain) with the ``heuristic`` judgements (``base``), which also serve preemption planning
  and explanations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby

from xpupool.placement.demand import Demand
from xpupool.placement.engine import (
    HeuristicPolicy,
    Placement,
    PlacementConfig,
    PlacementPolicy,
    PolicyRegistry,
    class_cost_key,
    place_in_class,
    simple_policies,
)
from xpupool.placement.inventory import LeaseState
from xpupool.placement.node_policies import TracePolicy, pod_demand
from xpupool.placement.online import DEFAULT_HALF_LIFE, OnlineFragmentationPolicy
from xpupool.placement.pool import WorkingPool
from xpupool.placement.state import MILLI, PodDemand

__all__ = ["DEFAULT_POLICY_NAME", "ONLINE_POLICY", "DefaultPolicy", "default_registry", "lease_pod"]

#: The name queues and ``placement.default_policy`` select it by (the built-in default).
DEFAULT_POLICY_NAME = "xpupool"
#: The replay's name of the same policy (``xpupool replay --policy xpupool-online``).
ONLINE_POLICY = "xpupool-online"


def lease_pod(lease: LeaseState) -> PodDemand:
    """The shape of a live lease, as the fragmentation metric sees a request (any model)."""
    slices = lease.slices
    cpu = sum(h.cpu_milli for h in lease.host)
    memory = sum(h.memory_mib for h in lease.host)
    if not slices:
        return PodDemand(cpu_milli=cpu, memory_mib=memory)
    whole = all(s.whole for s in slices)
    milli = MILLI if whole else min(MILLI, max(1, max(s.compute_pct for s in slices) * 10))
    return PodDemand(cpu_milli=cpu, memory_mib=memory, num_gpu=len(slices), gpu_milli=milli)


@dataclass
class DefaultPolicy(TracePolicy):
    """``xpupool``: see the module docstring."""

    online: OnlineFragmentationPolicy = field(
        default_factory=lambda: OnlineFragmentationPolicy(learn_on_choose=False)
    )
    _seeded: bool = field(default=False, repr=False)

    @classmethod
    def create(
        cls, cfg: PlacementConfig | None = None, half_life: float = DEFAULT_HALF_LIFE
    ) -> DefaultPolicy:
        """The default policy with the classic judgements configured by ``cfg``."""
        online = OnlineFragmentationPolicy(half_life, learn_on_choose=False)
        return cls(DEFAULT_POLICY_NAME, online, {}, HeuristicPolicy(cfg), online=online)

    def cycle_registry(
        self, cfg: PlacementConfig, extra: Sequence[PlacementPolicy] = ()
    ) -> PolicyRegistry:
        """The registry a scheduling cycle decides with (the service's and the replay's one way
        to build it): this policy, the per-class policies configured by ``cfg``
        (:func:`~xpupool.placement.engine.simple_policies`), then ``extra`` (the trace
        policies). The ``heuristic`` policy configured by ``cfg`` also serves this policy's
        per-class judgements."""
        simple = simple_policies(cfg)
        self.base = simple[0]
        registry = PolicyRegistry({p.name: p for p in (self, *simple)}, cfg.default_policy)
        for policy in extra:
            registry = registry.with_policy(policy)
        return registry

    def warm(self, pool: WorkingPool) -> None:
        """Do now, off any request's path, what the next decision on ``pool`` would do first:
        bring the node view in step with the pool (built whole after a start or a change of
        inventory: about 40 ms at 10,000 devices), once seed the learned shapes from the
        pool's live leases (about 25 ms there), and bring the costs kept for the shapes decided
        last up to date on the rows that changed (``FragmentationPolicy.warm``). These are
        caches of the pool, so decisions are the same with or without them; the seed is taken
        from the leases live now rather than when the first request is decided."""
        view = self.view(pool)
        self._seed(pool)
        self.online.warm(view.state)

    # -- learning ---------------------------------------------------------------------------

    def observe(self, job_id: str, demand: Demand, pool: WorkingPool) -> None:
        """Count one request's shape (once per job id)."""
        self._seed(pool)
        self.online.observe(self._pod(pool, demand), job_id)

    def _seed(self, pool: WorkingPool) -> None:
        if self._seeded:
            return
        self._seeded = True
        for placed in pool.leases.values():
            lease = placed.state
            if lease.slices or lease.host:
                self.online.observe(lease_pod(lease), lease.job_id)

    def _pod(self, pool: WorkingPool, demand: Demand) -> PodDemand:
        if demand.count < 1:
            return PodDemand(cpu_milli=demand.cpu_milli, memory_mib=demand.host_memory_mib)
        models = {pool.classes[ci].model for ci in demand.classes}
        every = {c.model for c in pool.classes}
        return pod_demand(pool, demand, None if models >= every else frozenset(models))

    # -- placement --------------------------------------------------------------------------

    def place_pool(
        self,
        pool: WorkingPool,
        demand: Demand,
        classes: Sequence[int],
        *,
        respect_holds: bool = True,
    ) -> Placement | None:
        """The first intent tier where the demand fits, fragmentation-scored within the tier."""
        if demand.count < 1:
            return super().place_pool(pool, demand, classes, respect_holds=respect_holds)
        # Gangs across nodes and gangs in one interconnect domain are the engine's gang term
        # (the node view chooses one row, so one node and one model): a domain gang always, a
        # gang allowed across nodes when no single node holds it.
        multi = demand.count > 1
        scored = not (multi and demand.scope == "domain")
        for tier in self._tiers(pool, demand, classes):
            if scored:
                found = super().place_pool(pool, demand, tier, respect_holds=respect_holds)
                if found is not None:
                    return found
            if not scored or (multi and demand.scope == "any"):
                for ci in tier:
                    pl = place_in_class(pool, demand, self.base, ci, respect_holds=respect_holds)
                    if pl is not None:
                        return replace(pl, policy=self.name)
        return None

    def _tiers(self, pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> list[list[int]]:
        """``classes`` (already in intent order) cut where the intent's sort key changes."""

        def key(ci: int) -> tuple[float, float]:
            return class_cost_key(pool.classes[ci], demand, demand.intent)

        return [list(group) for _, group in groupby(classes, key=key)]


def default_registry(cfg: PlacementConfig | None = None) -> PolicyRegistry:
    """A fresh default policy's cycle registry: what a scheduler without history decides with."""
    c = cfg or PlacementConfig()
    return DefaultPolicy.create(c).cycle_registry(c)
