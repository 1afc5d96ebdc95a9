"""Placement: which devices on which nodes serve a demand, under a pluggable policy.

The engine (:func:`place`) is shared; a :class:`PlacementPolicy` only supplies three judgements:

* ``rank_classes``: the order in which device classes are tried (heterogeneity: the request's
  intent, cheapest / fastest / balanced, against the catalog's cost and capacity);
* ``device_score``: which devices on a node to take (higher is better);
* ``node_score``: which node to take (higher is better).

Policies are looked up by name in a :class:`PolicyRegistry` and selected per queue. A node-scoring
function (for instance the FGD scorer of ``xpupool.placement``) plugs in with
:class:`ScoredPolicy` without touching the engine.

Topology: scope ``node`` puts every slice on one node; ``domain`` puts them in one interconnect
domain (NVLink / HCCS / MLU-Link; a device without a domain is its node's own domain); ``any``
prefers one node, then fills the fewest nodes. Host demand is charged on every node used.

Host-only demands (``count: 0``) take no device: :func:`place_host_only` charges their CPU and
memory on one node, and their :class:`Placement` has no devices and ``class_index``
:data:`HOST_ONLY`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard, runtime_checkable

import numpy as np

from xpupool.placement.demand import Demand
from xpupool.placement.pool import DeviceClass, WorkingPool, domain_key

__all__ = [
    "HOST_ONLY",
    "BinpackPolicy",
    "DelegatedJudgements",
    "LearningPolicy",
    "NodeScorer",
    "Placement",
    "PlacementPolicy",
    "PolicyRegistry",
    "PoolPlacementPolicy",
    "ScoredPolicy",
    "SpreadPolicy",
    "HeuristicPolicy",
    "class_cost_key",
    "simple_policies",
    "eligible_devices",
    "place",
    "place_host_only",
    "place_in_class",
    "placeable_count",
    "places_pool_wide",
    "learns",
]


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """The operator's placement settings (the ``placement:`` section of the queue file)."""

    default_policy: str = "xpupool"
    hot_util_pct: float = 85.0
    typical_share_pct: float = 25.0


HOST_ONLY = -1
"""``Placement.class_index`` of a host-only placement (no device, so no device class)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a demand goes: devices of one class, the share on each, host charges per node.

    A host-only placement has no devices and ``class_index`` :data:`HOST_ONLY`.
    """

    class_index: int
    devices: tuple[int, ...]
    memory_mib: int
    compute_pct: int
    whole: bool
    host: tuple[tuple[int, int, int], ...]
    """(node index, cpu_milli, memory_mib) charged on each node used."""
    score: float
    policy: str


class PlacementPolicy(Protocol):
    """What a placement policy decides; see the module docstring."""

    @property
    def name(self) -> str:
        """The name queues select the policy by."""
        ...

    def rank_classes(self, pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> list[int]:
        """The matching classes in the order to try them."""
        ...

    def device_score(
        self, pool: WorkingPool, i: int, memory_mib: int, compute_pct: int, whole: bool
    ) -> float:
        """How good device ``i`` is for one slice (higher is better)."""
        ...

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """How good node ``ni`` is when it takes devices ``chosen`` (higher is better)."""
        ...


@runtime_checkable
class PoolPlacementPolicy(PlacementPolicy, Protocol):
    """A policy that places a demand across the whole pool at once instead of class by class.

    The engine's class loop takes the first class where a demand fits; a policy whose score
    compares nodes of different models (the trace policies of ``xpupool.placement``: FGD, ours)
    needs every allowed class in one decision. ``place_pool`` must not mutate ``pool``; the
    other three judgements still serve preemption planning and explanations.
    """

    def place_pool(
        self,
        pool: WorkingPool,
        demand: Demand,
        classes: Sequence[int],
        *,
        respect_holds: bool = True,
    ) -> Placement | None:
        """Where ``demand`` goes on devices of ``classes`` (quota-allowed), or ``None``."""
        ...


@runtime_checkable
class LearningPolicy(Protocol):
    """A policy that learns from the request stream (the default one learns request shapes).

    :func:`~.decide.decide_batch` shows it every valid request it decides, whatever the queue,
    once per decision; ``observe`` must be idempotent per ``job_id`` because a waiting request is
    decided again in every cycle.
    """

    def observe(self, job_id: str, demand: Demand, pool: WorkingPool) -> None:
        """Learn from one request."""
        ...


def places_pool_wide(policy: PlacementPolicy) -> TypeGuard[PoolPlacementPolicy]:
    """``isinstance(policy, PoolPlacementPolicy)`` without typing's protocol check, which walks
    the protocol's members on every call (a fifth of a small decision's time): a placement
    policy is pool-wide when it has ``place_pool``."""
    return callable(getattr(policy, "place_pool", None))


def learns(policy: object) -> TypeGuard[LearningPolicy]:
    """``isinstance(policy, LearningPolicy)``, as cheaply (see ``places_pool_wide``)."""
    return callable(getattr(policy, "observe", None))


NodeScorer = Callable[[WorkingPool, int, Sequence[int], Demand, int], float]
"""Signature of a pluggable node scorer: (pool, node index, chosen devices, demand, memory_mib)."""


# ----------------------------------------------------------------------------------------------
# Class ranking by intent.
# ----------------------------------------------------------------------------------------------


def class_cost_key(cls: DeviceClass, demand: Demand, intent: str) -> tuple[float, float]:
    """Sort key of a class for ``intent`` (smaller first).

    * ``cheapest``: the hourly cost of the slices the request takes (a light share on a big,
      expensive device can cost more than a whole cheap one), then the weaker class, so strong
      devices stay free for requests only they can serve;
    * ``fastest``: the highest capacity, then the cheaper;
    * ``balanced``: the lowest cost per capacity unit (price/performance), then the faster.

    * ``any``: no preference, every class ranks equal (the policy's own score decides).

    A class without a price (0) is priced at its capacity units, so capacity still orders it.
    """
    if intent == "any":
        return (0.0, 0.0)
    price = cls.cost_per_hour if cls.cost_per_hour > 0 else cls.capacity_units
    if intent == "fastest":
        return (-cls.capacity_units, price)
    if intent == "balanced":
        return (price / max(cls.capacity_units, 1e-9), -cls.capacity_units)
    mem, compute = demand.share(cls)
    frac = 1.0 if demand.whole else max(compute / 100.0, mem / max(cls.memory_total_mib, 1))
    return (price * frac, cls.capacity_units)


class _Base:
    """Shared parts: intent ranking and the load/fragmentation knobs."""

    def __init__(self, cfg: PlacementConfig | None = None) -> None:
        c = cfg or PlacementConfig()
        self.hot_util_pct = c.hot_util_pct
        self.typical_share = c.typical_share_pct / 100.0

    def rank_classes(self, pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> list[int]:
        """Order matching classes by the request's intent (:func:`class_cost_key`)."""
        return sorted(
            classes, key=lambda ci: (*class_cost_key(pool.classes[ci], demand, demand.intent), ci)
        )

    @staticmethod
    def _busy_after(pool: WorkingPool, ni: int, chosen: Sequence[int]) -> float:
        total = len(pool.node_devs[ni]) or 1
        newly = sum(1 for i in chosen if pool.dev_holders[i] == 0 and not pool.dev_exclusive[i])
        return (pool.node_busy[ni] + newly) / total


class BinpackPolicy(_Base):
    """Fill the busiest nodes and the fullest devices first (HAMi/KAI ``binpack``)."""

    name = "binpack"

    def device_score(
        self, pool: WorkingPool, i: int, memory_mib: int, compute_pct: int, whole: bool
    ) -> float:
        """Least memory and compute left over after the slice."""
        if whole:
            return 0.0
        total = pool.devices[i].memory_total_mib or 1
        return (
            -((pool.dev_mem_free[i] - memory_mib) / total)
            - (pool.dev_compute_free[i] - compute_pct) / 100.0
        )

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """Fraction of the node's devices in use afterwards."""
        return self._busy_after(pool, ni, chosen)


class SpreadPolicy(_Base):
    """Fill the emptiest nodes and devices first (HAMi/KAI ``spread``)."""

    name = "spread"

    def device_score(
        self, pool: WorkingPool, i: int, memory_mib: int, compute_pct: int, whole: bool
    ) -> float:
        """Most memory and compute left over after the slice."""
        if whole:
            return 0.0
        total = pool.devices[i].memory_total_mib or 1
        return (pool.dev_mem_free[i] - memory_mib) / total + (
            pool.dev_compute_free[i] - compute_pct
        ) / 100.0

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """Fraction of the node's devices idle afterwards."""
        return 1.0 - self._busy_after(pool, ni, chosen)


class HeuristicPolicy(_Base):
    """``heuristic``: binpack that is load-, fragmentation- and host-aware, one device class at a
    time (the default policy's judgements for gangs, preemption planning and explanations).

    * Shares go to devices that are already shared (whole devices stay whole for whole-device
      and gang requests), where they cost the fewest *typical shares* (``typical_share_pct`` of
      the device's memory) the device could still host, then best fit on memory, and away from
      hot devices (``util_pct`` above ``hot_util_pct``).
    * Nodes are packed (fewer half-used nodes, so gangs find whole nodes) but a placement that
      would strand idle devices without host CPU is penalized.
    """

    name = "heuristic"

    def device_score(
        self, pool: WorkingPool, i: int, memory_mib: int, compute_pct: int, whole: bool
    ) -> float:
        """See the class docstring; whole devices only prefer the least loaded."""
        util = pool.devices[i].util_pct or 0.0
        load = 2.0 if util >= self.hot_util_pct else 0.3 * util / 100.0
        if whole:
            return -load
        total = pool.devices[i].memory_total_mib or 1
        free = pool.dev_mem_free[i]
        # Fragmentation: how many typical shares this device could host before vs after (FGD's
        # idea on one device); then best fit on what is left.
        typ = max(1, int(total * self.typical_share))
        lost = free // typ - (free - memory_mib) // typ
        s = 1.0 if pool.dev_holders[i] > 0 else 0.0
        s -= 0.3 * lost
        s -= 0.5 * (free - memory_mib) / total
        return s - load

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """Pack nodes, penalize stranding devices without CPU, and prefer idle devices' nodes."""
        busy = self._busy_after(pool, ni, chosen)
        node = pool.nodes[ni]
        strand = 0.0
        if node.cpu_milli_total > 0:
            cpu_left = (pool.node_cpu_free[ni] - demand.cpu_milli) / node.cpu_milli_total
            strand = max(0.0, (1.0 - busy) - cpu_left)
        s = busy - 0.5 * strand
        if not demand.whole:
            s += sum(self.device_score(pool, i, memory_mib, 0, False) for i in chosen) / max(
                len(chosen), 1
            )
        return s


class DelegatedJudgements:
    """The engine's three judgements taken from ``self.base``: for a policy that decides
    elsewhere (a plugged-in node scorer, a pool-wide policy) and keeps another policy's per-class
    judgements for the engine's work (preemption planning, explanations, gangs)."""

    __slots__ = ()
    base: PlacementPolicy

    def rank_classes(self, pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> list[int]:
        """Delegated to ``base``."""
        return self.base.rank_classes(pool, demand, classes)

    def device_score(
        self, pool: WorkingPool, i: int, memory_mib: int, compute_pct: int, whole: bool
    ) -> float:
        """Delegated to ``base``."""
        return self.base.device_score(pool, i, memory_mib, compute_pct, whole)

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """Delegated to ``base``."""
        return self.base.node_score(pool, ni, chosen, demand, memory_mib)


@dataclass(frozen=True, slots=True)
class ScoredPolicy(DelegatedJudgements):
    """A policy whose node score comes from a plugged-in function (e.g. an FGD scorer).

    Class ranking and device choice are delegated to ``base``.
    """

    name: str
    node_scorer: NodeScorer
    base: PlacementPolicy = field(default_factory=HeuristicPolicy)

    def node_score(
        self, pool: WorkingPool, ni: int, chosen: Sequence[int], demand: Demand, memory_mib: int
    ) -> float:
        """The plugged-in scorer."""
        return self.node_scorer(pool, ni, chosen, demand, memory_mib)


@dataclass(frozen=True, slots=True)
class PolicyRegistry:
    """Policies by name. Immutable: :meth:`with_policy` returns a new registry."""

    policies: Mapping[str, PlacementPolicy]
    default: str = "xpupool"

    def get(self, name: str | None) -> PlacementPolicy:
        """The policy called ``name``, or the default one when ``name`` is None or unknown."""
        if name is not None and name in self.policies:
            return self.policies[name]
        return self.policies[self.default]

    def with_policy(self, policy: PlacementPolicy) -> PolicyRegistry:
        """A copy with ``policy`` added or replaced."""
        return PolicyRegistry({**self.policies, policy.name: policy}, self.default)

    @property
    def names(self) -> tuple[str, ...]:
        """Registered policy names (pass them to ``load_config(known_policies=...)``)."""
        return tuple(self.policies)


def simple_policies(cfg: PlacementConfig | None = None) -> list[PlacementPolicy]:
    """The per-class policies: ``heuristic``, ``binpack`` and ``spread``, configured by ``cfg``.

    The default policy and the registry a scheduling cycle uses are in
    :mod:`xpupool.placement.default`.
    """
    c = cfg or PlacementConfig()
    return [HeuristicPolicy(c), BinpackPolicy(c), SpreadPolicy(c)]


# ----------------------------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------------------------


def eligible_devices(
    pool: WorkingPool, demand: Demand, devs: Iterable[int], memory_mib: int, compute_pct: int
) -> list[int]:
    """Devices among ``devs`` that can take one slice of ``demand`` now."""
    ok, holders, excl = pool.dev_ok, pool.dev_holders, pool.dev_exclusive
    if demand.whole:
        out = [i for i in devs if ok[i] and holders[i] == 0 and not excl[i]]
    else:
        mf, cf = pool.dev_mem_free, pool.dev_compute_free
        out = [
            i
            for i in devs
            if ok[i] and not excl[i] and mf[i] >= memory_mib and cf[i] >= compute_pct
        ]
    if demand.id_filtered:
        allowed, avoided = demand.allowed, demand.avoided
        out = [i for i in out if (allowed is None or i in allowed) and i not in avoided]
    return out


def _best(
    pool: WorkingPool,
    policy: PlacementPolicy,
    elig: list[int],
    k: int,
    mem: int,
    comp: int,
    whole: bool,
) -> list[int]:
    if len(elig) <= k and k > 1:
        return elig
    if k == 1:
        score = policy.device_score
        return [max(elig, key=lambda i: (score(pool, i, mem, comp, whole), -i))]
    scored = sorted(elig, key=lambda i: (-policy.device_score(pool, i, mem, comp, whole), i))
    return scored[:k]


_VECTOR_MIN_DEVICES = 64
"""Below this many devices in a class, numpy's fixed cost exceeds scoring device by device."""


def place_in_class(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    ci: int,
    *,
    nodes: Collection[int] | None = None,
    respect_holds: bool = True,
) -> Placement | None:
    """The best placement of ``demand`` on devices of class ``ci`` now, or ``None``.

    Single-slice demands under the default :class:`HeuristicPolicy` on a large class (or whenever
    ``pool.fast_placement`` is True) take :func:`_place_one_vectorized`, which returns exactly
    what the straightforward scoring below returns; ``pool.fast_placement = False`` forces the
    straightforward path.
    """
    cls = pool.classes[ci]
    mem, comp = demand.share(cls)
    if mem > cls.memory_total_mib:
        return None
    fast = pool.fast_placement
    if (
        fast is not False
        and demand.count == 1
        and nodes is None
        and not demand.id_filtered
        and type(policy) is HeuristicPolicy  # a subclass may override the scores
        and (fast or len(pool.class_devs[ci]) >= _VECTOR_MIN_DEVICES)
    ):
        return _place_one_vectorized(pool, demand, policy, ci, mem, comp, respect_holds)
    k = demand.count
    single = demand.scope == "node"
    quick = single and demand.whole and not demand.id_filtered
    wf = pool.class_whole_free[ci]
    held = pool.held_nodes if respect_holds else ()
    cpu, hmem = demand.cpu_milli, demand.host_memory_mib
    cpu_free, mem_free = pool.node_cpu_free, pool.node_mem_free
    cands: list[tuple[int, list[int]]] = []
    for ni, devs in pool.class_nodes[ci].items():
        if quick and wf.get(ni, 0) < k:
            continue
        if (nodes is not None and ni not in nodes) or ni in held:
            continue
        if cpu_free[ni] < cpu or mem_free[ni] < hmem:
            continue
        elig = eligible_devices(pool, demand, devs, mem, comp)
        if len(elig) >= (k if single else 1):
            cands.append((ni, elig))
    if not cands:
        return None

    whole = demand.whole
    best_pl: Placement | None = None
    # One node when it can: fewer nodes is never worse for a job. A domain-scoped gang goes to
    # the grouping below even then, because one node may hold several interconnect domains.
    for ni, elig in cands:
        if len(elig) < k or demand.scope == "domain":
            continue
        chosen = _best(pool, policy, elig, k, mem, comp, whole)
        s = policy.node_score(pool, ni, chosen, demand, mem)
        if best_pl is None or s > best_pl.score:
            best_pl = Placement(
                ci, tuple(chosen), mem, comp, whole, ((ni, cpu, hmem),), s, policy.name
            )
    if best_pl is not None or single:
        return best_pl

    if demand.scope == "domain":
        groups: dict[str, list[tuple[int, list[int]]]] = {}
        for ni, elig in cands:
            by_dom: dict[str, list[int]] = {}
            node_id = pool.nodes[ni].node_id
            for i in elig:
                by_dom.setdefault(domain_key(pool.devices[i].domain, node_id), []).append(i)
            for dk, devs in by_dom.items():
                groups.setdefault(dk, []).append((ni, devs))
        for members in groups.values():
            pl = _fill(pool, policy, demand, ci, members, mem, comp)
            if pl is not None and (best_pl is None or pl.score > best_pl.score):
                best_pl = pl
        return best_pl
    return _fill(pool, policy, demand, ci, cands, mem, comp)


def _place_one_vectorized(
    pool: WorkingPool,
    demand: Demand,
    policy: HeuristicPolicy,
    ci: int,
    mem: int,
    comp: int,
    respect_holds: bool,
) -> Placement | None:
    """:func:`place_in_class` for one slice under :class:`HeuristicPolicy`, scored with numpy.

    Mirrors the straightforward path operation for operation so every float is bit-identical:
    the same eligibility, ``HeuristicPolicy.device_score`` per device (ties to the lowest device
    index), ``node_score`` per node with its best device (ties to the first node in
    ``class_nodes`` order). The returned score is recomputed by the policy itself.
    """
    lay = pool.class_layout(ci)
    arr = pool.arrays()
    devs = lay.devs
    mf = arr.mem_free[devs]
    holders = arr.holders[devs]
    excl = arr.exclusive[devs]
    whole = demand.whole
    if whole:
        elig = lay.ok & (holders == 0) & ~excl
    else:
        elig = lay.ok & ~excl & (mf >= mem) & (arr.compute_free[devs] >= comp)
    seg_nodes = lay.seg_nodes
    cpu, hmem = demand.cpu_milli, demand.host_memory_mib
    node_ok = (arr.node_cpu_free[seg_nodes] >= cpu) & (arr.node_mem_free[seg_nodes] >= hmem)
    if respect_holds and pool.held_nodes:
        held = np.fromiter(pool.held_nodes, dtype=np.int64, count=len(pool.held_nodes))
        node_ok &= ~np.isin(seg_nodes, held)
    elig &= node_ok[lay.dev_seg]
    if not elig.any():
        return None

    util = lay.util
    load = np.where(util >= policy.hot_util_pct, 2.0, 0.3 * util / 100.0)
    if whole:
        score = -load
    else:
        total = lay.memory_total
        typ = np.maximum((total * policy.typical_share).astype(np.int64), 1)
        left = mf - mem
        lost = mf // typ - left // typ
        s = np.where(holders > 0, 1.0, 0.0)
        s = s - 0.3 * lost
        s = s - 0.5 * left / total
        score = s - load

    # Best device per node: the highest score, then the lowest index (devices are ascending
    # within a node, so the first position holding the node's maximum).
    masked = np.where(elig, score, -np.inf)
    starts = lay.seg_starts
    seg_max = np.maximum.reduceat(masked, starts)
    n = len(devs)
    pos = np.where(elig & (masked == seg_max[lay.dev_seg]), np.arange(n), n)
    first = np.minimum.reduceat(pos, starts)
    valid = first < n
    segs = np.flatnonzero(valid)
    at = first[segs]
    ns = seg_nodes[segs]

    # node_score of each candidate node with its best device.
    newly = ((holders[at] == 0) & ~excl[at]).astype(np.int64)
    busy = (arr.node_busy[ns] + newly) / arr.node_ndevs[ns]
    cpu_total = arr.node_cpu_total[ns]
    has_cpu = cpu_total > 0
    cpu_left = (arr.node_cpu_free[ns] - cpu) / np.where(has_cpu, cpu_total, 1)
    gap = (1.0 - busy) - cpu_left
    strand = np.where(has_cpu & (gap > 0.0), gap, 0.0)
    node_s = busy - 0.5 * strand
    if not whole:
        node_s = node_s + score[at]
    best = int(np.argmax(node_s))  # the first of equal maxima, like the strict ``>`` loop
    ni = int(ns[best])
    dev = int(devs[at[best]])
    sc = policy.node_score(pool, ni, [dev], demand, mem)
    return Placement(ci, (dev,), mem, comp, whole, ((ni, cpu, hmem),), sc, policy.name)


def _fill(
    pool: WorkingPool,
    policy: PlacementPolicy,
    demand: Demand,
    ci: int,
    members: list[tuple[int, list[int]]],
    mem: int,
    comp: int,
) -> Placement | None:
    """Fill ``demand`` across nodes, the nodes holding the most eligible devices first."""
    k = demand.count
    if sum(len(e) for _, e in members) < k:
        return None
    order = sorted(
        members,
        key=lambda m: (-len(m[1]), -policy.node_score(pool, m[0], m[1][:1], demand, mem), m[0]),
    )
    chosen: list[int] = []
    host: list[tuple[int, int, int]] = []
    score = 0.0
    for ni, elig in order:
        take = _best(pool, policy, elig, min(len(elig), k - len(chosen)), mem, comp, demand.whole)
        chosen.extend(take)
        host.append((ni, demand.cpu_milli, demand.host_memory_mib))
        score += policy.node_score(pool, ni, take, demand, mem)
        if len(chosen) >= k:
            break
    leftover = sum(len(e) for _, e in members) - k
    # Between groups (domains), fewest nodes first, then the tightest fit (least leftover).
    score = score / len(host) - len(host) - 0.01 * leftover
    return Placement(ci, tuple(chosen), mem, comp, demand.whole, tuple(host), score, policy.name)


def place(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    *,
    classes: Sequence[int] | None = None,
    nodes: Collection[int] | None = None,
    respect_holds: bool = True,
) -> Placement | None:
    """The first class, in the policy's order, where ``demand`` fits now, and where in it."""
    for ci in classes if classes is not None else policy.rank_classes(pool, demand, demand.classes):
        pl = place_in_class(pool, demand, policy, ci, nodes=nodes, respect_holds=respect_holds)
        if pl is not None:
            return pl
    return None


def place_host_only(
    pool: WorkingPool,
    demand: Demand,
    policy: PlacementPolicy,
    *,
    respect_holds: bool = True,
) -> Placement | None:
    """One node for a host-only demand (``count: 0``): its CPU and host memory, no device.

    Among the nodes with that much CPU and memory free (not held for a starved job unless
    ``respect_holds`` is off, and not lost: a node whose devices are all lost is down), the charge
    should strand the fewest idle devices (healthy, nobody holding them): nodes without an idle
    device first, then the most CPU left per idle device; ties go to the first node in pool
    order. ``policy`` only names the placement.
    """
    n = len(pool.nodes)
    if n == 0:
        return None
    cpu, mem = demand.cpu_milli, demand.host_memory_mib
    arr = pool.arrays()
    fits = (arr.node_cpu_free >= cpu) & (arr.node_mem_free >= mem)
    if respect_holds and pool.held_nodes:
        fits[list(pool.held_nodes)] = False
    cands = np.flatnonzero(fits)
    if len(cands) == 0:
        return None
    idle_dev = pool.devices_ok & (arr.holders == 0) & ~arr.exclusive
    idle = np.bincount(
        np.array(pool.dev_node, dtype=np.int64), weights=idle_dev, minlength=n
    ).astype(np.int64)[cands]
    cpu_left = arr.node_cpu_free[cands] - cpu
    per_idle = np.where(idle > 0, cpu_left / np.maximum(idle, 1), 0.0)
    # Sorted by: an idle device stranded or not, then most CPU per idle device, then pool order.
    for k in np.lexsort((cands, -per_idle, idle > 0)):
        ni = int(cands[k])
        if pool.node_up[ni]:
            return Placement(
                HOST_ONLY, (), 0, 0, False, ((ni, cpu, mem),), -float(idle[k]), policy.name
            )
    return None


def placeable_count(pool: WorkingPool, demand: Demand, ci: int) -> int:
    """How many slices of ``demand`` class ``ci`` could take now ignoring topology (for gangs)."""
    cls = pool.classes[ci]
    mem, comp = demand.share(cls)
    n = 0
    for ni, devs in pool.class_nodes[ci].items():
        if (
            pool.node_cpu_free[ni] >= demand.cpu_milli
            and pool.node_mem_free[ni] >= demand.host_memory_mib
        ):
            n += len(eligible_devices(pool, demand, devs, mem, comp))
    return n
