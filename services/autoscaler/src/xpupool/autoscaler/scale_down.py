"""Scale-down: which idle nodes to drain, which drained nodes to remove (pure, no I/O).

Rules, per pool, in this order (``now`` and every timestamp in epoch seconds):

1. **Demand back, drains undone.** If actionable pending demand could use the pool
   (``PoolLoad.pending_jobs``), every draining node is undrained (``demand_returned``) and
   nothing is drained or removed: a node that is still there serves the burst sooner than a new
   one.
2. **Removal only when empty.** A draining node with no lease left is removed (``drained``).
   One that still holds leases stays; under drain policy ``preempt`` its leases are preempted
   once, with the pool's ``grace_s`` (``drain_grace``), and it is removed when they are gone.
3. **Drain with cool-down and hysteresis.** A ready node is a candidate only after it has been
   idle ``scale_down.cooldown_s`` without a break (``idle_since``: since when it has done no
   work; a node that worked again has a new ``idle_since``), so a short lull drains nothing.
   Candidates go longest-idle first, and each one drains only while the pool keeps at least
   ``min_size`` nodes and the **recent peak** of busy nodes (``PoolLoad.recent_peak_busy``: the
   most nodes busy at once over at least the cool-down window) stays at most
   ``scale_down.low_watermark`` of the nodes left. With a peak of 3 and a watermark of 0.7 a
   pool keeps 5 nodes: the last burst's nodes plus headroom, so the next one finds them.
   A predictive pool also keeps what its forecast wants at the provisioning horizon
   (``keep_nodes``): drained, those nodes would be added again at the next cycle (while they
   drain the pool's size leaves them out), a node's whole provisioning paid again for nothing.

Scale-up happens only for pending demand beyond capacity, scale-down only below the watermark:
the band between the two is the hysteresis. A pool's size counts its ready and provisioning
nodes, not the draining ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xpupool.autoscaler.decisions import DemandSummary, ScaleStep
from xpupool.autoscaler.pools import PoolConfig
from xpupool.contracts import DrainPolicy, ScaleAction, ScaleReason

__all__ = ["NodeStatus", "PoolLoad", "peak_busy", "plan_scale_down"]


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One node of a pool as the ledger sees it.

    ``idle_since``: since when the node has done no work (no lease, or only leases whose devices
    show no utilisation); ``None`` while it works. ``draining_since``: when it was drained;
    ``None`` if it takes grants. ``preempt_requested``: its leases were already preempted for
    the drain. ``ready``: false while it is being provisioned (never drained then)."""

    node_id: str
    idle_since: float | None = None
    lease_ids: tuple[str, ...] = ()
    draining_since: float | None = None
    preempt_requested: bool = False
    ready: bool = True


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """Recent demand on one pool: the peak of busy nodes over the cool-down window (at least),
    and the actionable pending jobs the pool could serve now."""

    recent_peak_busy: int = 0
    pending_jobs: tuple[str, ...] = ()


def peak_busy(history: Iterable[tuple[float, int]], now: float, window_s: float) -> int:
    """The most busy nodes at once among ``(at, busy)`` samples of the last ``window_s``."""
    return max((busy for at, busy in history if now - window_s <= at <= now), default=0)


def plan_scale_down(
    pool: PoolConfig,
    nodes: Sequence[NodeStatus],
    load: PoolLoad,
    now: float,
    *,
    provisioning: int = 0,
    keep_nodes: int = 0,
) -> tuple[ScaleStep, ...]:
    """The drain, undrain, preempt and remove steps of one pool (see the module docstring).

    ``nodes`` are the pool's nodes with an id; ``provisioning`` counts nodes being provisioned
    that the provider has not named yet (they count toward the size, so toward ``min_size``);
    ``keep_nodes``: what a predictive pool's forecast wants (``forecast_nodes``), kept like
    ``min_size``."""
    draining = sorted((n for n in nodes if n.draining_since is not None), key=_drain_order)
    if load.pending_jobs:
        if not draining:
            return ()
        return (
            ScaleStep(
                action=ScaleAction.UNDRAIN,
                pool=pool.name,
                reason=ScaleReason.DEMAND_RETURNED,
                node_ids=tuple(n.node_id for n in draining),
                demand=DemandSummary(job_ids=load.pending_jobs),
                detail=f"{len(load.pending_jobs)} pending jobs could use the pool",
            ),
        )

    steps: list[ScaleStep] = []
    empty = tuple(n.node_id for n in draining if not n.lease_ids)
    if empty:
        steps.append(
            ScaleStep(
                action=ScaleAction.REMOVE,
                pool=pool.name,
                reason=ScaleReason.DRAINED,
                node_ids=empty,
                detail="drained: no lease left",
            )
        )
    if pool.drain.policy is DrainPolicy.PREEMPT:
        for n in draining:
            if n.lease_ids and not n.preempt_requested:
                steps.append(
                    ScaleStep(
                        action=ScaleAction.PREEMPT,
                        pool=pool.name,
                        reason=ScaleReason.DRAIN_GRACE,
                        node_ids=(n.node_id,),
                        lease_ids=n.lease_ids,
                        grace_s=pool.drain.grace_s,
                        detail=(
                            f"{len(n.lease_ids)} leases preempted with {pool.drain.grace_s:g} s "
                            "grace"
                        ),
                    )
                )

    active = [n for n in nodes if n.draining_since is None]
    remaining = len(active) + provisioning
    cooldown = pool.scale_down.cooldown_s
    candidates = sorted(
        (
            n
            for n in active
            if n.ready and n.idle_since is not None and now - n.idle_since >= cooldown
        ),
        key=lambda n: (n.idle_since, n.node_id),
    )
    drained: list[str] = []
    floor = max(pool.min_size, keep_nodes)
    for n in candidates:
        left = remaining - 1
        if left < floor:
            break
        if load.recent_peak_busy > pool.scale_down.low_watermark * left:
            break
        drained.append(n.node_id)
        remaining = left
    if drained:
        steps.append(
            ScaleStep(
                action=ScaleAction.DRAIN,
                pool=pool.name,
                reason=ScaleReason.IDLE,
                node_ids=tuple(drained),
                detail=(
                    f"idle at least {cooldown:g} s; recent peak {load.recent_peak_busy} busy "
                    f"nodes, {remaining} left (low watermark {pool.scale_down.low_watermark:g})"
                ),
            )
        )
    return tuple(steps)


def _drain_order(n: NodeStatus) -> tuple[float, str]:
    return (n.draining_since or 0.0, n.node_id)
