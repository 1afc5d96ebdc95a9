"""The autoscaler's plan: steps, each with its reason and the demand it answers (pure, no I/O).

A :class:`ScalePlan` is what one decision cycle wants done: scale-up steps (from the scale-up
solver, ``min_size``, or the forecast), and the scale-down steps of
:func:`xpupool.autoscaler.scale_down.plan_scale_down`. :meth:`ScalePlan.events` turns it into the
``ScaleDecision`` events of the contract; a step's ``decision_id`` doubles as the provider
request id, so a replica that takes over and replays the step reaches the provider with the same
idempotency key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from xpupool.autoscaler.pools import PoolConfig
from xpupool.contracts import ScaleAction, ScaleDecision, ScaleDemand, ScaleReason

__all__ = [
    "DemandSummary",
    "ScalePlan",
    "ScaleStep",
    "plan_min_size",
    "forecast_nodes",
    "plan_predictive",
]

MAX_LISTED_JOBS = 1024  # ScaleDemand.job_ids holds at most this many; ``jobs`` counts all


@dataclass(frozen=True, slots=True)
class DemandSummary:
    """The demand a step answers: the pending jobs it serves, their devices (a share counts as
    its fraction) and capacity units, and the forecast a predictive step acted on."""

    job_ids: tuple[str, ...] = ()
    devices: float = 0.0
    capacity_units: float = 0.0
    forecast_devices: float | None = None

    def to_contract(self) -> ScaleDemand:
        """The contract's ``ScaleDemand`` (job ids listed up to 1,024, all counted)."""
        return ScaleDemand(
            job_ids=list(self.job_ids[:MAX_LISTED_JOBS]),
            jobs=len(self.job_ids),
            devices=round(self.devices, 6),
            capacity_units=round(self.capacity_units, 6),
            forecast_devices=(
                None if self.forecast_devices is None else round(self.forecast_devices, 6)
            ),
        )


@dataclass(frozen=True, slots=True)
class ScaleStep:
    """One thing to do to one pool. ``count`` nodes for ``scale_up``; ``node_ids`` for drain,
    undrain, remove and preempt; ``lease_ids`` and ``grace_s`` for preempt."""

    action: ScaleAction
    pool: str
    reason: ScaleReason
    count: int = 0
    node_ids: tuple[str, ...] = ()
    demand: DemandSummary = field(default_factory=DemandSummary)
    detail: str = ""
    lease_ids: tuple[str, ...] = ()
    grace_s: float = 0.0

    @property
    def nodes(self) -> int:
        """How many nodes the step concerns."""
        return self.count if self.action is ScaleAction.SCALE_UP else len(self.node_ids)

    def size_delta(self) -> int:
        """What the step does to the pool's size (ready or provisioning, not draining)."""
        match self.action:
            case ScaleAction.SCALE_UP | ScaleAction.UNDRAIN:
                return self.nodes
            case ScaleAction.DRAIN:
                return -self.nodes
        return 0  # remove and preempt act on nodes already out of the size

    def cost_delta(self, pool: PoolConfig | None) -> float:
        """Cost per hour the step adds (negative: saves). Draining nodes still cost until they
        are removed."""
        price = pool.cost_per_hour if pool is not None else 0.0
        match self.action:
            case ScaleAction.SCALE_UP:
                return self.nodes * price
            case ScaleAction.REMOVE:
                return -self.nodes * price
        return 0.0


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """Every step of one decision cycle, and why the demand left over is not served."""

    steps: tuple[ScaleStep, ...] = ()
    #: job id -> why no step serves it (blocked by quota, every fitting pool at max_size, ...)
    unserved: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def for_pool(self, pool: str) -> tuple[ScaleStep, ...]:
        """The steps of one pool, in plan order."""
        return tuple(s for s in self.steps if s.pool == pool)

    def merged(self, other: ScalePlan) -> ScalePlan:
        """This plan's steps then ``other``'s; unserved reasons of both (``other`` wins)."""
        return ScalePlan(
            steps=(*self.steps, *other.steps), unserved={**self.unserved, **other.unserved}
        )

    @staticmethod
    def decision_id(cycle: str, index: int, step: ScaleStep) -> str:
        """The deterministic id of a step: the cycle's key (for example the leader's fencing
        token and cycle number), its place in the plan, its pool and action."""
        return f"{cycle}:{index}:{step.pool}:{step.action.value}"

    def events(
        self,
        pools: Mapping[str, PoolConfig],
        sizes: Mapping[str, int],
        *,
        cycle: str,
        at: datetime,
    ) -> list[ScaleDecision]:
        """One ``ScaleDecision`` per step; ``sizes`` are the pools' sizes before the plan and
        each step's ``size_after`` includes the earlier steps of its pool."""
        running = dict(sizes)
        out: list[ScaleDecision] = []
        for index, step in enumerate(self.steps):
            before = running.get(step.pool, 0)
            after = before + step.size_delta()
            running[step.pool] = after
            decision_id = self.decision_id(cycle, index, step)
            request = (
                decision_id if step.action in (ScaleAction.SCALE_UP, ScaleAction.REMOVE) else None
            )
            out.append(
                ScaleDecision(
                    decision_id=decision_id,
                    pool=step.pool,
                    action=step.action,
                    reason=step.reason,
                    detail=step.detail[:1024],
                    count=step.nodes,
                    node_ids=list(step.node_ids[:MAX_LISTED_JOBS]),
                    size_before=before,
                    size_after=after,
                    demand=step.demand.to_contract(),
                    cost_per_hour_delta=round(step.cost_delta(pools.get(step.pool)), 6),
                    request_id=request,
                    at=at,
                )
            )
        return out


def plan_min_size(pools: Sequence[PoolConfig], sizes: Mapping[str, int]) -> tuple[ScaleStep, ...]:
    """Scale-up steps that bring every pool to its ``min_size`` (sizes count ready and
    provisioning nodes, not draining ones)."""
    steps = []
    for pool in pools:
        missing = pool.min_size - sizes.get(pool.name, 0)
        if missing > 0:
            steps.append(
                ScaleStep(
                    action=ScaleAction.SCALE_UP,
                    pool=pool.name,
                    reason=ScaleReason.BELOW_MIN_SIZE,
                    count=missing,
                    detail=f"{sizes.get(pool.name, 0)} nodes, min_size {pool.min_size}",
                )
            )
    return tuple(steps)


def forecast_nodes(pool: PoolConfig, forecast_devices: float) -> int:
    """The nodes a predictive pool's forecast (devices in use at the provisioning horizon)
    wants, with the pool's headroom, within ``min_size`` and ``max_size``; 0 for a pool that is
    not predictive or a forecast of nothing."""
    if not pool.predictive.enabled or forecast_devices <= 0:
        return 0
    wanted = math.ceil(forecast_devices * pool.predictive.headroom / pool.node.count - 1e-9)
    return min(pool.max_size, max(pool.min_size, wanted))


def plan_predictive(pool: PoolConfig, forecast_devices: float, size: int) -> ScaleStep | None:
    """A scale-up step for a predictive pool whose forecast needs more nodes
    (``forecast_nodes``) than its ``size`` (ready and provisioning); ``None`` when it needs
    none or is not predictive.

    The scale-down keeps what the forecast wants (``plan_scale_down``'s ``keep_nodes``): a node
    the forecast added is drained once it has stayed idle and the forecast no longer wants it,
    not while it does, only to be added again at the next cycle."""
    target = forecast_nodes(pool, forecast_devices)
    if target <= size:
        return None
    return ScaleStep(
        action=ScaleAction.SCALE_UP,
        pool=pool.name,
        reason=ScaleReason.FORECAST,
        count=target - size,
        demand=DemandSummary(
            devices=forecast_devices,
            capacity_units=forecast_devices * pool.capacity_units / pool.node.count,
            forecast_devices=forecast_devices,
        ),
        detail=(
            f"forecast {forecast_devices:.1f} devices in {pool.provisioning_delay_s:g} s "
            f"needs {target} nodes, the pool has {size}"
        ),
    )
