"""Victim selection: which leases to end so that a request fits, at the least cost.

**Who may be preempted** by a request of priority *p* from leaf queue *Q* (and only leases that
are preemptible, whose queue is preemptible, that are not already ending, and that have run at
least ``preemption.min_runtime_s``):

* a lease of *Q* itself with priority < *p* (priority preemption inside a queue);
* an over-quota (borrowed) lease of another queue, when the request is in-quota (reclaim) or
  the lease's priority is < *p*. In quota means on the device class it would be placed on: a
  request that the guarantee covers only on another model (or that a units guarantee covers
  only on a cheaper class) reclaims nothing where it would itself be borrowing.

In-quota leases of other queues are never taken: their guarantee is a promise.

**Which ones.** Candidates are ordered over-quota first, then lowest priority, then youngest
(least work lost), then largest. The search simulates, it does not estimate: it releases
candidates one by one in that order, on one candidate node at a time (or on the whole pool for
multi-node gangs), until the request fits under its quota; then it drops every victim that turns
out not to be needed. Among nodes, the plan with the fewest victims wins, then the one whose
worst victim is cheapest, then the least runtime lost. The pool is restored exactly afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xpupool.placement.demand import Demand
from xpupool.placement.engine import Placement, PlacementPolicy, place_in_class
from xpupool.placement.pool import PoolLease, WorkingPool
from xpupool.scheduler.domain.config import SchedulerConfig

__all__ = ["PreemptionPlan", "can_preempt", "plan_preemption", "victim_key"]


@dataclass(frozen=True, slots=True)
class PreemptionPlan:
    """End ``victims``, then ``placement`` fits."""

    victims: tuple[str, ...]
    placement: Placement


def can_preempt(
    victim: PoolLease,
    *,
    queue: str,
    priority: int,
    in_quota: bool,
    config: SchedulerConfig,
    now_s: float,
    ignore_min_runtime: bool = False,
) -> bool:
    """Whether a request (``queue``, ``priority``, ``in_quota``) may end ``victim`` (once it has
    run ``preemption.min_runtime_s``, with ``ignore_min_runtime``)."""
    st = victim.state
    if st.terminating or not st.preemptible:
        return False
    if not ignore_min_runtime and now_s - st.started_at_s < config.preemption.min_runtime_s:
        return False
    if victim.queue == queue:
        allowed = st.priority < priority
    elif victim.over_quota:
        allowed = in_quota or st.priority < priority
    else:
        return False
    # The queue's own setting last: a plan asks this of every lease in the pool, and most are
    # ruled out above without a lookup.
    qc = config.queue(victim.queue) if allowed else None
    return allowed and (qc is None or qc.preemptible)


def victim_key(v: PoolLease) -> tuple[int, int, float, float, str]:
    """Preemption order, smallest first: over-quota, low priority, young, large."""
    return (
        0 if v.over_quota else 1,
        v.state.priority,
        -v.state.started_at_s,
        -v.units,
        v.state.lease_id,
    )


def _cost(pool: WorkingPool, victims: Sequence[str]) -> tuple[int, tuple[int, int], float]:
    worst = max(
        ((0 if pool.leases[v].over_quota else 1, pool.leases[v].state.priority) for v in victims),
        default=(0, 0),
    )
    lost = sum(pool.now_s - pool.leases[v].state.started_at_s for v in victims)
    return (len(victims), worst, lost)


def plan_preemption(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    classes: Sequence[int],
    *,
    queue: str,
    priority: int,
    in_quota: bool,
    config: SchedulerConfig,
    quota_ok: Callable[[int], bool],
    respect_holds: bool = True,
    ready: dict[str, PoolLease] | None = None,
    young: dict[str, PoolLease] | None = None,
    candidates: dict[str, PoolLease] | None = None,
    in_quota_on: Callable[[int], bool] | None = None,
) -> PreemptionPlan | None:
    """The cheapest set of leases whose end lets ``demand`` fit, or ``None``.

    ``classes`` are tried in order; the first class with any plan wins (the intent's order is
    kept even under preemption). ``quota_ok(class_index)`` re-checks the queue's quota on the
    simulated pool, so preempting a lease of one's own queue can also make room under a limit.
    ``ready`` and ``young``, when given, collect the leases the request may end and those only
    their minimum run time protects (in the same pass over the leases); ``candidates`` replaces
    the pass (a plan over given leases). ``in_quota`` says whether the request is in quota on
    some class; ``in_quota_on(class_index)``, when given, whether on that one: a plan on a class
    where it is not reclaims nothing its priority alone would not take.
    """
    cfg = config.preemption
    if not cfg.enabled:
        return None
    if candidates is None:
        candidates = {}
        for lid, pl in pool.leases.items():
            if not (pl.queue == queue or pl.over_quota) or not can_preempt(
                pl,
                queue=queue,
                priority=priority,
                in_quota=in_quota,
                config=config,
                now_s=pool.now_s,
                ignore_min_runtime=True,
            ):
                continue
            if pool.now_s - pl.state.started_at_s >= cfg.min_runtime_s:
                candidates[lid] = pl
            elif young is not None:
                young[lid] = pl
        if ready is not None:
            ready.update(candidates)
    if not candidates:
        return None
    # Leases only a reclaim may take (borrowed by another queue, not of a lower priority): a
    # class where the request would itself be borrowing leaves them alone, or its own new lease,
    # over quota, is theirs to take back at once (the two queues would preempt each other for
    # ever).
    reclaim_only = (
        {
            lid
            for lid, pl in candidates.items()
            if pl.queue != queue and pl.state.priority >= priority
        }
        if in_quota and in_quota_on is not None
        else set()
    )
    for ci in classes:
        usable = candidates
        if reclaim_only and in_quota_on is not None and not in_quota_on(ci):
            usable = {lid: pl for lid, pl in candidates.items() if lid not in reclaim_only}
            if not usable:
                continue
        plan = (
            _plan_per_node(
                pool,
                demand,
                policy,
                ci,
                usable,
                quota_ok,
                cfg.max_victims,
                cfg.max_candidate_nodes,
                respect_holds,
            )
            if demand.scope == "node"
            else _plan_global(
                pool, demand, policy, ci, usable, quota_ok, cfg.max_victims, respect_holds
            )
        )
        if plan is not None:
            return plan
    return None


def _fits(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    ci: int,
    quota_ok: Callable[[int], bool],
    nodes: set[int] | None,
    respect_holds: bool,
) -> Placement | None:
    if not quota_ok(ci):
        return None
    return place_in_class(pool, demand, policy, ci, nodes=nodes, respect_holds=respect_holds)


def _search(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    ci: int,
    ordered: list[str],
    quota_ok: Callable[[int], bool],
    max_victims: int,
    nodes: set[int] | None,
    respect_holds: bool,
) -> tuple[list[str], Placement] | None:
    """Release ``ordered`` one by one until it fits, minimize, restore; the pool ends unchanged."""
    released: list[PoolLease] = []
    try:
        fit: Placement | None = None
        for lid in ordered[:max_victims]:
            pl = pool.release(lid)
            if pl is None:
                continue
            released.append(pl)
            fit = _fits(pool, demand, policy, ci, quota_ok, nodes, respect_holds)
            if fit is not None:
                break
        if fit is None:
            return None
        # Give back, most valuable first, every victim the request turns out not to need.
        for pl in sorted(released, key=victim_key, reverse=True):
            pool.restore(pl)
            again = _fits(pool, demand, policy, ci, quota_ok, nodes, respect_holds)
            if again is None:
                pool.release(pl.state.lease_id)
            else:
                released.remove(pl)
                fit = again
        victims = [pl.state.lease_id for pl in released]
        return victims, fit
    finally:
        pool.restore_many(released)


def _plan_per_node(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    ci: int,
    candidates: dict[str, PoolLease],
    quota_ok: Callable[[int], bool],
    max_victims: int,
    max_nodes: int,
    respect_holds: bool,
) -> PreemptionPlan | None:
    nodes: list[tuple[float, int, list[str]]] = []
    for ni in pool.class_nodes[ci]:
        if respect_holds and ni in pool.held_nodes:
            continue
        on = [candidates[lid] for lid in pool.node_leases[ni] if lid in candidates]
        if not on:
            continue
        on.sort(key=victim_key)
        freeable = sum(v.units for v in on)
        nodes.append((-freeable, ni, [v.state.lease_id for v in on]))
    nodes.sort()
    best: tuple[tuple[int, tuple[int, int], float], list[str], Placement] | None = None
    for _, ni, ordered in nodes[:max_nodes]:
        found = _search(
            pool, demand, policy, ci, ordered, quota_ok, max_victims, {ni}, respect_holds
        )
        if found is None:
            continue
        victims, fit = found
        cost = _cost(pool, victims)
        if best is None or cost < best[0]:
            best = (cost, victims, fit)
            if cost[0] == 1 and cost[1][0] == 0:
                break  # one over-quota victim: cannot do better in count
    if best is None:
        return None
    return PreemptionPlan(tuple(best[1]), best[2])


def _plan_global(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    ci: int,
    candidates: dict[str, PoolLease],
    quota_ok: Callable[[int], bool],
    max_victims: int,
    respect_holds: bool,
) -> PreemptionPlan | None:
    class_nodes = pool.class_nodes[ci]
    ordered = sorted(
        (v for v in candidates.values() if any(n in class_nodes for n in v.nodes)),
        key=victim_key,
    )
    found = _search(
        pool,
        demand,
        policy,
        ci,
        [v.state.lease_id for v in ordered],
        quota_ok,
        max_victims,
        None,
        respect_holds,
    )
    if found is None:
        return None
    return PreemptionPlan(tuple(found[0]), found[1])
