"""The scheduler's decisions: pure functions from (requests, ledger snapshot, config) to outcomes.

The I/O shell reads a :class:`~.model.PoolSnapshot` from Redis, calls :func:`decide_batch` with
the pending requests, and for each ``(job_id, decision)``:

* :class:`Reserve`: commit the slices and host charges with the Lua script (which re-checks
  capacity, health and quota); on a failed commit the job simply stays pending for the next cycle;
* :class:`Preempt`: send ``EndLease(reason=preempted)`` for each victim, mark the job nominated
  (``PendingRequest.nominated``) and mark the victims ``terminating`` / ``preempted_for`` in later
  snapshots; the job is reserved by a later cycle once the slices are back;
* :class:`Wait`: publish ``JobPending`` with the reason;
* :class:`Reject` / :class:`TimedOut`: publish the terminal event.

Within a batch every reservation and preemption is applied to the working pool, so the batch
never hands out the same capacity twice.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from xpupool.contracts.payloads import DeviceSlice, JobRequested, JobReserved, Vendor
from xpupool.devices.enforcement import slice_enforced
from xpupool.placement.default import default_registry
from xpupool.placement.demand import Demand, make_demand
from xpupool.placement.engine import (
    LearningPolicy,
    Placement,
    PlacementPolicy,
    PolicyRegistry,
    eligible_devices,
    learns,
    place_host_only,
    place_in_class,
    placeable_count,
    places_pool_wide,
)
from xpupool.placement.inventory import (
    HostCharge,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)
from xpupool.placement.pool import PoolLease, WorkingPool, domain_key
from xpupool.scheduler.domain.config import QueueConfig, SchedulerConfig, config_of, default_config
from xpupool.scheduler.domain.fairshare import (
    FairOrder,
    FairShareHistory,
    HeadKey,
    effective_priority,
    priority_bands,
    share_path,
)
from xpupool.scheduler.domain.matching import never_fits
from xpupool.scheduler.domain.preemption import plan_preemption
from xpupool.scheduler.domain.quota import (
    QuotaVerdict,
    below_guarantee,
    check_quota,
    check_quotas,
    refresh_over_quota,
)
from xpupool.scheduler.domain.reasons import Reason

__all__ = [
    "Decision",
    "PendingRequest",
    "Preempt",
    "Reject",
    "Reserve",
    "TimedOut",
    "Wait",
    "apply_decision",
    "decide",
    "decide_batch",
]


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request waiting in the scheduler, with what the shell remembers about it."""

    request: JobRequested
    enqueued_at_s: float
    nominated: bool = False
    """Leases were preempted for it and have not all ended yet."""
    last_reason: str = ""


@dataclass(frozen=True, slots=True)
class Reserve:
    """Reserve these slices (and host resources) for the job."""

    job_id: str
    tenant: str
    owner: str
    queue: str
    priority: int
    lease_ttl_s: float
    slices: tuple[DeviceSlice, ...]
    host: tuple[HostCharge, ...]
    capacity_units: float
    in_quota: bool
    policy: str
    max_runtime_s: float | None = None
    """The smaller of the request's and the leaf queue's maximum run time (None: unbounded)."""
    idle_reclaim_s: float | None = None
    """The leaf queue's idle reclaim time (None: the queue did not opt in)."""

    def to_event(self, lease_id: str) -> JobReserved:
        """The contract event for this reservation; ``lease_id`` is minted by the shell."""
        return JobReserved(
            job_id=self.job_id,
            lease_id=lease_id,
            tenant=self.tenant,
            owner=self.owner,
            queue=self.queue,
            priority=self.priority,
            lease_ttl_s=self.lease_ttl_s,
            slices=list(self.slices),
        )


@dataclass(frozen=True, slots=True)
class Preempt:
    """End ``victims`` (lease ids) as preempted; ``reserve`` is what the job will then get."""

    job_id: str
    victims: tuple[str, ...]
    reserve: Reserve
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Wait:
    """The job stays pending; ``reason`` is from :class:`~.reasons.Reason`."""

    job_id: str
    reason: Reason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Reject:
    """The job can never be placed: terminal. ``field`` is the dotted input path to blame."""

    job_id: str
    reason: Reason
    field: str | None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The job waited past ``max_wait_s``: terminal."""

    job_id: str
    waited_s: float
    last_reason: Reason
    reason: Reason = Reason.MAX_WAIT_EXCEEDED


Decision = Reserve | Preempt | Wait | Reject | TimedOut


@dataclass(slots=True)
class _Ctx:
    config: SchedulerConfig
    registry: PolicyRegistry
    history: FairShareHistory | None
    now_s: float
    learners: tuple[LearningPolicy, ...] = ()
    incoming: frozenset[str] = frozenset()
    """Jobs that nodes being provisioned (by the autoscaler) will serve."""
    growable: tuple[NodeState, ...] = ()
    """Nodes the autoscaler's pools could add (empty, each pool's maximum of them)."""
    _grown: WorkingPool | None = None

    def grown(self, pool: WorkingPool) -> WorkingPool:
        """The pool with every node the pools could add: what could ever be placed."""
        if self._grown is None:
            snapshot = PoolSnapshot(nodes=(*pool.nodes, *self.growable), now_s=pool.now_s)
            self._grown = WorkingPool(snapshot, self.config)
        return self._grown


def _vendor(v: str) -> Vendor:
    try:
        return Vendor(v)
    except ValueError:
        return Vendor.SIMULATED


def _reserve(
    pool: WorkingPool, req: JobRequested, queue: str, priority: int, pl: Placement, in_quota: bool
) -> Reserve:
    slices = []
    units = 0.0
    for i in pl.devices:
        d = pool.devices[i]
        mem = d.memory_total_mib if pl.whole else pl.memory_mib
        comp = 100 if pl.whole else pl.compute_pct
        units += d.capacity_units * pool.slice_fraction(i, mem, comp, pl.whole)
        slices.append(
            DeviceSlice(
                device_id=d.device_id,
                node_id=d.node_id,
                vendor=_vendor(d.vendor),
                model=d.model,
                index=d.index,
                uuid=d.uuid,
                memory_mib=mem,
                compute_pct=comp,
                whole=pl.whole,
                enforced=slice_enforced(_vendor(d.vendor), d.isolation, pl.whole, uuid=d.uuid),
            )
        )
    host = tuple(HostCharge(pool.nodes[ni].node_id, cpu, mem) for ni, cpu, mem in pl.host)
    leaf = config_of(pool).queue(queue)
    return Reserve(
        job_id=req.job_id,
        tenant=req.tenant or "",
        owner=req.owner or req.tenant or "",
        queue=queue,
        priority=priority,
        lease_ttl_s=req.lease_ttl_s,
        slices=tuple(slices),
        host=host,
        capacity_units=units,
        in_quota=in_quota,
        policy=pl.policy,
        max_runtime_s=_max_runtime(req.max_runtime_s, leaf),
        idle_reclaim_s=leaf.idle_reclaim_s if leaf else None,
    )


def _max_runtime(requested: float | None, queue: QueueConfig | None) -> float | None:
    limits = [x for x in (requested, queue.max_runtime_s if queue else None) if x is not None]
    return min(limits) if limits else None


def apply_decision(pool: WorkingPool, decision: Decision, now_s: float | None = None) -> None:
    """Apply a Reserve/Preempt to ``pool`` as if committed (victims released, slices taken).

    The reservation becomes a non-preemptible pseudo-lease ``reservation:<job_id>``.
    """
    if isinstance(decision, Preempt):
        pool.release_many(decision.victims)
        r = decision.reserve
    elif isinstance(decision, Reserve):
        r = decision
    else:
        return
    pool.add_lease(
        LeaseState(
            lease_id=f"reservation:{r.job_id}",
            job_id=r.job_id,
            tenant=r.tenant,
            queue=r.queue,
            priority=r.priority,
            started_at_s=pool.now_s if now_s is None else now_s,
            slices=tuple(
                LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole) for s in r.slices
            ),
            capacity_units=r.capacity_units,
            preemptible=False,
            host=r.host,
        )
    )


def _policy_for(ctx: _Ctx, queue: str) -> PlacementPolicy:
    q = ctx.config.queue(queue)
    return ctx.registry.get(
        q.placement if q is not None and q.placement else ctx.config.placement.default_policy
    )


@dataclass(slots=True)
class _Outcome:
    decision: Decision
    demand: Demand | None = None
    classes: tuple[int, ...] = ()
    claim: Preempt | None = None
    """For a job waiting for its victims to end: those victims and where it will then be placed,
    which the batch keeps for it (see :func:`_claim`)."""


def _decide_one(item: PendingRequest, pool: WorkingPool, ctx: _Ctx) -> _Outcome:
    req = item.request
    cfg = ctx.config
    demand = make_demand(req, pool)
    rej = never_fits(req, pool, cfg, demand)
    if (
        rej is not None
        and rej.reason in _GROWABLE
        and ctx.growable
        and never_fits(req, ctx.grown(pool), cfg) is None
    ):
        # No node holds it yet, but nodes a pool can add would: it waits, and the autoscaler
        # sees the demand.
        reason = Reason.NO_MATCHING_DEVICE if not demand.classes else Reason.INSUFFICIENT_CAPACITY
        return _Outcome(
            Wait(req.job_id, reason, f"only nodes a pool can add hold it ({rej.detail})")
        )
    if rej is not None:
        return _Outcome(Reject(req.job_id, rej.reason, rej.field, rej.detail))
    for learner in ctx.learners:
        learner.observe(req.job_id, demand, pool)
    queue = cfg.resolve_queue(req.tenant or "", req.queue)
    priority = cfg.priority_value(req.priority)
    assert queue is not None and priority is not None  # never_fits validated both
    policy = _policy_for(ctx, queue)
    backfill = cfg.starvation.backfill_max_duration_s
    may_backfill = (
        backfill > 0 and req.expected_duration_s is not None and req.expected_duration_s <= backfill
    )
    if demand.host_only:
        return _decide_host_only(item, pool, ctx, demand, policy, queue, priority, may_backfill)
    ranked = policy.rank_classes(pool, demand, demand.classes)

    verdicts = check_quotas(pool, cfg, queue, demand, ranked)
    allowed = tuple(ci for ci in ranked if verdicts[ci].allowed)
    if places_pool_wide(policy):
        # One decision over every allowed class (FGD-style scores compare models).
        found = policy.place_pool(pool, demand, allowed, respect_holds=not may_backfill)
        if found is not None:
            iq = verdicts[found.class_index].in_quota
            return _Outcome(_reserve(pool, req, queue, priority, found, iq), demand, allowed)
    else:
        for ci in allowed:
            pl = place_in_class(pool, demand, policy, ci, respect_holds=not may_backfill)
            if pl is not None:
                return _Outcome(
                    _reserve(pool, req, queue, priority, pl, verdicts[ci].in_quota),
                    demand,
                    allowed,
                )

    wait = _why_not(item, pool, ctx, demand, policy, queue, priority, ranked, allowed, verdicts)
    out = _Outcome(_timed_out(item, ctx, wait), demand, allowed)
    if isinstance(out.decision, Wait) and out.decision.reason is Reason.PREEMPTION_IN_PROGRESS:
        out.claim = _claim(item, pool, ctx, demand, policy, queue, priority, ranked)
    return out


def _claim(
    item: PendingRequest,
    pool: WorkingPool,
    ctx: _Ctx,
    demand: Demand,
    policy: PlacementPolicy,
    queue: str,
    priority: int,
    ranked: Sequence[int],
) -> Preempt | None:
    """The job's own ending victims (``preempted_for`` it) and where it fits once they are gone,
    or None. Until they end it does not fit, so nothing would keep what it was preempted for: a
    later request would take the free part of it (a device its gang counts on, the rest of a
    shared device) and the victims would have been ended for nothing. The batch applies the claim
    as it applied the preemption itself, so that part stays the job's."""
    job = item.request.job_id
    mine = [lid for lid in _ending(pool) if pool.leases[lid].state.preempted_for == job]
    if not mine:
        return None
    released = pool.release_many(mine)
    try:
        for ci in ranked:
            verdict = check_quota(pool, ctx.config, queue, demand, ci)
            if not verdict.allowed:
                continue
            pl = place_in_class(pool, demand, policy, ci)
            if pl is not None:
                reserve = _reserve(pool, item.request, queue, priority, pl, verdict.in_quota)
                return Preempt(job, tuple(mine), reserve, "kept while its victims end")
    finally:
        pool.restore_many(released)
    return None


def _timed_out(item: PendingRequest, ctx: _Ctx, wait: Decision) -> Decision:
    """``wait``, or TimedOut when the request has waited past its ``max_wait_s``."""
    req = item.request
    if isinstance(wait, Wait) and req.max_wait_s is not None:
        waited = ctx.now_s - item.enqueued_at_s
        if waited >= req.max_wait_s:
            return TimedOut(req.job_id, waited, wait.reason)
    return wait


def _decide_host_only(
    item: PendingRequest,
    pool: WorkingPool,
    ctx: _Ctx,
    demand: Demand,
    policy: PlacementPolicy,
    queue: str,
    priority: int,
    may_backfill: bool,
) -> _Outcome:
    """A host-only request (``count: 0``): CPU and host memory on one node, no device, no quota.

    A pool-wide policy places it with ``place_pool(pool, demand, ())`` (no class: host only);
    the others with :func:`~.placement.place_host_only`. It never preempts: when nothing fits it
    waits, saying whether ending leases or held nodes would let it in.
    """
    req = item.request
    if places_pool_wide(policy):
        found = policy.place_pool(pool, demand, (), respect_holds=not may_backfill)
    else:
        found = place_host_only(pool, demand, policy, respect_holds=not may_backfill)
    if found is not None:
        return _Outcome(_reserve(pool, req, queue, priority, found, True), demand)
    return _Outcome(
        _timed_out(item, ctx, _why_host_waits(req.job_id, pool, demand, policy, ctx)), demand
    )


def _why_host_waits(
    job: str, pool: WorkingPool, demand: Demand, policy: PlacementPolicy, ctx: _Ctx
) -> Wait:
    """Why a host-only request does not fit now (it never preempts)."""
    if job in ctx.incoming:
        return _incoming(job)
    ending = _ending(pool)
    if ending:
        released = pool.release_many(ending)
        try:
            fits = place_host_only(pool, demand, policy) is not None
        finally:
            pool.restore_many(released)
        if fits:
            return Wait(
                job,
                Reason.CAPACITY_INCOMING,
                f"fits once {len(ending)} ending lease(s) give their host resources back",
            )
    if pool.held_nodes and place_host_only(pool, demand, policy, respect_holds=False):
        return Wait(
            job,
            Reason.CAPACITY_RESERVED,
            f"fits only on {len(pool.held_nodes)} node(s) held for a starved job",
        )
    return Wait(
        job,
        Reason.INSUFFICIENT_CAPACITY,
        f"host-only: needs {demand.cpu_milli} mCPU and {demand.host_memory_mib} MiB of host "
        "memory free on one node",
    )


_GROWABLE: Final = frozenset(
    {
        Reason.UNKNOWN_MODEL,
        Reason.NO_MATCHING_DEVICE,
        Reason.SHARE_TOO_LARGE,
        Reason.EXCEEDS_NODE_CAPACITY,
        Reason.EXCEEDS_DOMAIN_CAPACITY,
        Reason.EXCEEDS_POOL_CAPACITY,
    }
)
"""Rejections that more nodes could answer (not an invalid request or a quota limit)."""


_HOLDS_FOR: Final = frozenset(
    {Reason.INSUFFICIENT_CAPACITY, Reason.WAITING_FOR_GANG, Reason.WAITING_FOR_MIN_RUNTIME}
)
"""Why a starved request may wait and still hold nodes. Waiting for its victims' minimum run
time too: else what frees there meanwhile goes to later requests, whose new leases are young
again (or not preemptible by it at all), and a stream of short jobs postpones it for ever."""


def _incoming(job: str) -> Wait:
    return Wait(job, Reason.CAPACITY_INCOMING, "nodes being provisioned for it will serve it")


def _ending(pool: WorkingPool) -> list[str]:
    """The leases whose end was requested, in the pool's order; none without a pass over every
    lease in the usual case (nothing is ending), which a request that does not fit pays."""
    if not pool.terminating:
        return []
    return [lid for lid, pl in pool.leases.items() if pl.state.terminating]


def _no_victims(pool: WorkingPool, queue: str, priority: int, in_quota: bool) -> bool:
    """True when no lease can be a preemption victim of (``queue``, ``priority``, ``in_quota``).
    ``can_preempt`` takes from one's own queue only a lower priority, and from another queue
    only an over-quota lease, of any priority for a request in quota, else of a lower one. So a
    request out of quota has no victim when no lease anywhere is of lower priority, and one in
    quota when, besides, no other queue holds leases. The plan would be empty; this saves its
    pass over every lease, which a cycle on a busy pool made for every job that waits."""
    if not in_quota:
        return all(p >= priority for counts in pool.queue_priorities.values() for p in counts)
    if any(lids for q, lids in pool.queue_leases.items() if q != queue):
        return False
    return all(p >= priority for p in pool.queue_priorities.get(queue, {}))


def _why_not(
    item: PendingRequest,
    pool: WorkingPool,
    ctx: _Ctx,
    demand: Demand,
    policy: PlacementPolicy,
    queue: str,
    priority: int,
    ranked: list[int],
    allowed: tuple[int, ...],
    verdicts: dict[int, QuotaVerdict],
) -> Decision:
    """It does not fit now: preempt, or explain why it waits (in this order of precedence)."""
    req = item.request
    cfg = ctx.config
    job = req.job_id
    if job in ctx.incoming:
        # Hardware is being bought for it: preempting someone now would only waste their work.
        return _incoming(job)
    ok, allowed_ids, avoided = pool.dev_ok, demand.allowed, demand.avoided
    healthy = any(
        ok[i] and (allowed_ids is None or i in allowed_ids) and i not in avoided
        for ci in ranked
        for i in pool.class_devs[ci]
    )
    if not healthy:
        return Wait(job, Reason.NO_MATCHING_DEVICE, "every matching device is unhealthy or lost")

    def quota_ok(ci: int) -> bool:
        return check_quota(pool, cfg, queue, demand, ci).allowed

    # Capacity already on its way back: do not preempt more while leases are ending.
    ending = _ending(pool)
    if ending:
        mine = any(pool.leases[lid].state.preempted_for == job for lid in ending)
        released = pool.release_many(ending)
        try:
            fits = any(
                quota_ok(ci) and place_in_class(pool, demand, policy, ci) is not None
                for ci in ranked
            )
        finally:
            pool.restore_many(released)
        if mine or (fits and item.nominated):
            return Wait(
                job,
                Reason.PREEMPTION_IN_PROGRESS,
                f"waiting for {len(ending)} preempted lease(s) to end",
            )
        if fits:
            return Wait(
                job,
                Reason.CAPACITY_INCOMING,
                f"fits once {len(ending)} ending lease(s) give their slices back",
            )

    if pool.held_nodes and any(
        place_in_class(pool, demand, policy, ci, respect_holds=False) for ci in allowed
    ):
        return Wait(
            job,
            Reason.CAPACITY_RESERVED,
            f"fits only on {len(pool.held_nodes)} node(s) held for a starved job",
        )

    in_quota = any(v.in_quota for v in verdicts.values())
    plan_for = functools.partial(
        plan_preemption,
        pool,
        demand,
        policy,
        ranked,
        queue=queue,
        priority=priority,
        in_quota=in_quota,
        config=cfg,
        quota_ok=quota_ok,
        in_quota_on=lambda ci: verdicts[ci].in_quota,
    )
    eligible: dict[str, PoolLease] = {}
    young: dict[str, PoolLease] = {}
    plan = (
        None
        if _no_victims(pool, queue, priority, in_quota)
        else plan_for(ready=eligible, young=young)
    )
    if plan is not None:
        iq = check_quota(pool, cfg, queue, demand, plan.placement.class_index).in_quota
        reserve = _reserve(pool, req, queue, priority, plan.placement, iq)
        if not plan.victims:
            # The policy's own view turned it away, the engine fits it without preempting
            # anyone (a pool-wide policy rounds differently): place it, never "preempt nobody".
            return reserve
        return Preempt(job, plan.victims, reserve, f"preempting {len(plan.victims)} lease(s)")
    if young:
        # Leases only their minimum run time protects: would ending them (and the others the
        # request may end) make it fit? Then it waits for them, not for capacity.
        patient = plan_for(candidates=eligible | young)
        if patient is not None and patient.victims:
            return Wait(
                job,
                Reason.WAITING_FOR_MIN_RUNTIME,
                f"would preempt {len(patient.victims)} lease(s) once they have run "
                f"preemption.min_runtime_s ({cfg.preemption.min_runtime_s:g}s)",
            )

    if not allowed:
        first = verdicts[ranked[0]]
        return Wait(job, Reason.QUOTA_EXHAUSTED, first.detail)
    if demand.gang:
        ready = max((placeable_count(pool, demand, ci) for ci in allowed), default=0)
        if ready > 0:
            where = {"node": "one node", "domain": "one interconnect domain", "any": "the pool"}[
                demand.scope
            ]
            return Wait(
                job,
                Reason.WAITING_FOR_GANG,
                f"{ready} of {demand.count} devices could be placed now; "
                f"the gang needs all of them on {where}",
            )
    cls = pool.classes[allowed[0]]
    free = placeable_count(pool, demand, allowed[0])
    return Wait(
        job,
        Reason.INSUFFICIENT_CAPACITY,
        f"needs {demand.count} x {cls.model}; {free} can take a slice now",
    )


def _hold_nodes(pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> set[int]:
    """Nodes where a starved request is likeliest to fit first; later requests must leave them."""
    if demand.host_only:
        # The node closest to fitting: able to hold it at all, with the most CPU free now.
        able = [
            ni
            for ni, node in enumerate(pool.nodes)
            if pool.node_up[ni]
            and node.cpu_milli_total >= demand.cpu_milli
            and node.memory_mib_total >= demand.host_memory_mib
        ]
        if not able:
            return set()
        return {max(able, key=lambda n: (pool.node_cpu_free[n], pool.node_mem_free[n], -n))}
    k = demand.count
    for ci in classes:
        mem, comp = demand.share(pool.classes[ci])
        free = {
            ni: len(eligible_devices(pool, demand, devs, mem, comp))
            for ni, devs in pool.class_nodes[ci].items()
            if pool.nodes[ni].cpu_milli_total >= demand.cpu_milli
            and pool.nodes[ni].memory_mib_total >= demand.host_memory_mib
        }
        if demand.scope == "node":
            big = [ni for ni in free if len(pool.class_nodes[ci][ni]) >= k]
            if big:
                return {max(big, key=lambda n: (free[n], pool.node_mem_free[n], -n))}
        elif demand.scope == "domain":
            doms: dict[str, list[int]] = {}
            for ni in free:
                for i in pool.class_nodes[ci][ni]:
                    dk = domain_key(pool.devices[i].domain, pool.nodes[ni].node_id)
                    if ni not in doms.setdefault(dk, []):
                        doms[dk].append(ni)
            fits = [
                (sum(free[n] for n in ns), dk)
                for dk, ns in doms.items()
                if sum(len(pool.class_nodes[ci][n]) for n in ns) >= k
            ]
            if fits:
                return set(doms[max(fits)[1]])
        else:
            out: set[int] = set()
            got = 0
            for ni in sorted(free, key=lambda n: (-free[n], n)):
                if got >= k:
                    break
                out.add(ni)
                got += len(pool.class_nodes[ci][ni])
            if got >= k:
                return out
    return set()


def _as_pending(x: PendingRequest | JobRequested, now_s: float) -> PendingRequest:
    return x if isinstance(x, PendingRequest) else PendingRequest(x, now_s)


def _setup(
    pool: PoolSnapshot | WorkingPool,
    config: SchedulerConfig | None,
    now_s: float | None,
    policies: PolicyRegistry | None,
    history: FairShareHistory | None,
) -> tuple[WorkingPool, _Ctx]:
    if isinstance(pool, WorkingPool):
        wp = pool
        cfg = config or config_of(pool)
    else:
        cfg = config or default_config()
        wp = WorkingPool(pool, cfg)
    if now_s is not None:
        wp.now_s = now_s
    refresh_over_quota(wp, cfg)
    registry = policies or default_registry(cfg.placement)
    learners = {id(p): p for p in registry.policies.values() if learns(p)}
    ctx = _Ctx(cfg, registry, history, wp.now_s, tuple(learners.values()))
    return wp, ctx


def decide(
    request: JobRequested | PendingRequest,
    pool: PoolSnapshot | WorkingPool,
    config: SchedulerConfig | None = None,
    *,
    now_s: float | None = None,
    policies: PolicyRegistry | None = None,
    apply: bool = False,
) -> Decision:
    """Decide one request against ``pool``.

    A :class:`~.model.PoolSnapshot` is turned into a fresh working pool; a
    :class:`~.pool.WorkingPool` is used as is and, with ``apply=True``, the decision is applied to
    it. ``now_s`` defaults to the snapshot's clock. ``config`` defaults to the pool's, or to
    :func:`~.config.default_config`.
    """
    wp, ctx = _setup(pool, config, now_s, policies, None)
    out = _decide_one(_as_pending(request, ctx.now_s), wp, ctx).decision
    if apply:
        apply_decision(wp, out, ctx.now_s)
    return out


def decide_batch(
    pending: Sequence[PendingRequest | JobRequested],
    pool: PoolSnapshot | WorkingPool,
    config: SchedulerConfig | None = None,
    *,
    now_s: float | None = None,
    policies: PolicyRegistry | None = None,
    history: FairShareHistory | None = None,
    incoming: frozenset[str] = frozenset(),
    growable: Sequence[NodeState] = (),
    apply_last: bool = True,
) -> list[tuple[str, Decision]]:
    """Decide every pending request against one snapshot, in fair-share order.

    ``incoming``: jobs that nodes being provisioned will serve; one that does not fit now waits
    ``capacity_incoming`` and preempts nothing. ``growable``: nodes the autoscaler's pools
    could add; a request only they could hold waits instead of being rejected.

    The order and the anti-starvation holds are described in :mod:`.fairshare`. Each Reserve and
    Preempt is applied to the working pool before the next request is considered, so the batch
    never over-allocates. A job still waiting for its victims to end keeps, for the rest of the
    batch, what it will be placed on once they have (:func:`_claim`); that is taken back out
    before returning. A :class:`~.pool.WorkingPool` passed in is mutated; a snapshot is not.
    With ``apply_last=False`` the batch's last decision is not applied (no request follows it),
    for a caller that takes every reservation back out of the pool anyway: a lone decision then
    neither adds its reservation to the pool nor removes it again.
    Returns ``(job_id, decision)`` in decision order, one per request.
    """
    wp, ctx = _setup(pool, config, now_s, policies, history)
    ctx.incoming = incoming
    ctx.growable = tuple(growable)
    cfg = ctx.config
    wp.held_nodes = set()
    items = [_as_pending(p, ctx.now_s) for p in pending]
    groups: dict[str, list[PendingRequest]] = {}
    rejected: list[tuple[str, Decision]] = []
    prio_of: dict[str, float] = {}
    for it in items:
        r = it.request
        q = cfg.resolve_queue(r.tenant or "", r.queue)
        p = cfg.priority_value(r.priority)
        if q is None or p is None:
            rej = never_fits(r, wp, cfg)
            assert rej is not None
            rejected.append((r.job_id, Reject(r.job_id, rej.reason, rej.field, rej.detail)))
            continue
        prio_of[r.job_id] = effective_priority(p, ctx.now_s - it.enqueued_at_s, cfg.aging)
        groups.setdefault(q, []).append(it)

    bands = priority_bands(cfg)

    def head_key(it: PendingRequest) -> HeadKey:
        priority = prio_of[it.request.job_id]
        return (
            0 if it.nominated else 1,
            -bands(priority),
            -priority,
            it.enqueued_at_s,
            it.request.job_id,
        )

    def queue_key(q: str) -> tuple[int, tuple[float, ...]]:
        return (0 if below_guarantee(wp, cfg, q) else 1, share_path(wp, cfg, history, q))

    out: list[tuple[str, Decision]] = list(rejected)
    claims: list[tuple[str, list[PoolLease]]] = []
    holds = 0
    to_decide = sum(len(group) for group in groups.values())
    order = FairOrder(groups, head_key, queue_key)
    for it in order:
        res = _decide_one(it, wp, ctx)
        d = res.decision
        to_decide -= 1
        if isinstance(d, Reserve | Preempt) and (apply_last or to_decide > 0):
            apply_decision(wp, d, ctx.now_s)
            if isinstance(d, Preempt):
                # A victim's end can bring a lease its queue borrowed back within the queue's
                # guarantee: re-mark, or a later request of the batch would reclaim it.
                refresh_over_quota(wp, cfg)
        elif res.claim is not None and to_decide > 0:
            # Its victims are still ending: what they give back, and the free capacity it will
            # be placed on with it, stay its own for the rest of the batch.
            victims = [wp.leases[v] for v in res.claim.victims]
            apply_decision(wp, res.claim, ctx.now_s)
            refresh_over_quota(wp, cfg)
            claims.append((res.claim.job_id, victims))
        elif (
            isinstance(d, Wait)
            and d.reason in _HOLDS_FOR
            and holds < cfg.starvation.max_holds
            and ctx.now_s - it.enqueued_at_s >= cfg.starvation.after_s
            and res.demand is not None
        ):
            held = _hold_nodes(wp, res.demand, res.classes)
            if held:
                wp.held_nodes |= held
                holds += 1
        out.append((it.request.job_id, d))
    # A claim is no decision: the pool leaves the batch as its decisions alone left it (its
    # victims still there, ending), which is what a caller taking them back out expects.
    for job_id, victims in reversed(claims):
        wp.release(f"reservation:{job_id}")
        wp.restore_many(victims)
    return out
