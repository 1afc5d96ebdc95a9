"""Fair share and ordering: who is considered first among pending requests.

**Weighted DRF with decay.** A queue's usage is a vector (devices, device memory, capacity
units). Its *dominant share* is the largest of the three fractions of the pool's totals, divided
by the queue's weight. The vector used is a blend of what the queue holds now and its recent
usage: ``(1 - w) * now + w * history``, where ``history`` is an exponentially decayed average with
half-life ``fair_share.half_life_s`` (:func:`update_history`, which the shell calls each cycle and
persists). Hierarchy: a queue's key is the tuple of shares from the top of the tree down to it, so
siblings compete first on their parents' shares, then on their own (a light form of H-DRF).

**Order.** Requests are taken queue by queue (the queue with the best key offers its best
request), and the key is re-evaluated after every reservation, so a queue that just got capacity
falls behind. The key, smaller first:

1. requests whose victims are already being preempted (so the freed capacity is theirs);
2. the priority *band*, highest first: the highest priority class the request's effective
   priority has reached. The effective priority is the class number plus *aging*
   (``aging.rate_per_s`` x seconds waited, at most ``aging.max_boost``), so aging lifts a
   request into a higher class once it has waited long enough, a bounded boost that prevents
   starvation, but between requests of one band it decides nothing: were the continuous value
   compared here, the longest-waiting head would always win and arrival order would override
   the weights. Aging only orders; it never grants preemption rights;
3. queues still below their guarantee before borrowers;
4. the hierarchical weighted dominant share, lowest first, so two queues weighted 2:1 with equal
   backlogs get about 2:1 of what frees up;
5. the effective priority itself, then arrival time, then job id (deterministic replay).

Within one queue, requests go by band, effective priority (aging included) and arrival.

**No starvation of large requests.** Aging makes a large request climb above the stream of small
ones; once it has waited ``starvation.after_s`` and still does not fit, it *holds* the node (or
domain, or nodes) where it is likeliest to fit: later requests of the batch may not use held
nodes (reason ``capacity_reserved``), so capacity freed there accumulates for it. Requests that
declare an ``expected_duration_s`` up to ``starvation.backfill_max_duration_s`` may backfill held
nodes. At most ``starvation.max_holds`` requests hold nodes at once.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from xpupool.placement.pool import WorkingPool
from xpupool.scheduler.domain.config import AgingConfig, SchedulerConfig

__all__ = [
    "FairOrder",
    "FairShareHistory",
    "UsageVector",
    "current_usage",
    "dominant_share",
    "effective_priority",
    "share_path",
    "update_history",
]


@dataclass(frozen=True, slots=True)
class UsageVector:
    """Devices (shares fractional), device memory (MiB) and capacity units."""

    devices: float = 0.0
    memory_mib: float = 0.0
    units: float = 0.0

    def blend(self, other: UsageVector, w_other: float) -> UsageVector:
        """``(1 - w) * self + w * other``."""
        a = 1.0 - w_other
        return UsageVector(
            a * self.devices + w_other * other.devices,
            a * self.memory_mib + w_other * other.memory_mib,
            a * self.units + w_other * other.units,
        )


@dataclass(frozen=True, slots=True)
class FairShareHistory:
    """Decayed average usage per queue; the shell keeps it between cycles (it is tiny)."""

    updated_at_s: float = 0.0
    usage: Mapping[str, UsageVector] = field(default_factory=dict)


def current_usage(pool: WorkingPool) -> dict[str, UsageVector]:
    """What each queue (subtree included) holds in ``pool`` now."""
    return {q: UsageVector(u.devices, u.memory_mib, u.units) for q, u in pool.usage.items()}


def update_history(
    history: FairShareHistory | None,
    current: Mapping[str, UsageVector],
    now_s: float,
    half_life_s: float,
) -> FairShareHistory:
    """Fold ``current`` into the decayed average; the past's weight halves every ``half_life_s``."""
    if history is None or not history.usage:
        return FairShareHistory(now_s, dict(current))
    dt = max(0.0, now_s - history.updated_at_s)
    keep = 0.5 ** (dt / half_life_s) if half_life_s > 0 else 0.0
    zero = UsageVector()
    out: dict[str, UsageVector] = {}
    for q in set(history.usage) | set(current):
        v = history.usage.get(q, zero).blend(current.get(q, zero), 1.0 - keep)
        if v.devices > 1e-6 or v.units > 1e-6 or v.memory_mib > 1e-3:
            out[q] = v
    return FairShareHistory(now_s, out)


def dominant_share(pool: WorkingPool, v: UsageVector, weight: float) -> float:
    """max(devices, memory, units fractions of the pool) / weight."""
    return max(
        v.devices / pool.total_devices,
        v.memory_mib / pool.total_memory_mib,
        v.units / pool.total_units,
    ) / max(weight, 1e-9)


def share_path(
    pool: WorkingPool, config: SchedulerConfig, history: FairShareHistory | None, queue: str
) -> tuple[float, ...]:
    """Weighted dominant shares from the top-level ancestor down to ``queue``."""
    w = config.fair_share.history_weight if history is not None else 0.0
    out = []
    for q in reversed(config.path(queue)[:-1]):  # root excluded: everyone shares it
        u = pool.usage.get(q)
        now = UsageVector(u.devices, u.memory_mib, u.units) if u else UsageVector()
        past = history.usage.get(q) if history is not None else None
        v = now.blend(past, w) if past is not None else now.blend(UsageVector(), w)
        qc = config.queue(q)
        out.append(dominant_share(pool, v, qc.weight if qc else 1.0))
    return tuple(out)


def effective_priority(priority: int, waited_s: float, aging: AgingConfig) -> float:
    """The class number plus the aging boost (capped)."""
    return priority + min(aging.max_boost, aging.rate_per_s * max(0.0, waited_s))


def priority_bands(config: SchedulerConfig) -> Callable[[float], float]:
    """``band(effective priority)``: the highest priority class value it has reached (the
    lowest class value when below every class, as an explicit number may be)."""
    values = sorted(set(config.priority_classes.values()))

    def band(priority: float) -> float:
        i = bisect.bisect_right(values, priority)
        return float(values[i - 1]) if i else priority

    return band


#: Within-queue order of a request: (nominated first, -band, -effective priority, arrival, id).
HeadKey = tuple[int, float, float, float, str]
OrderKey = tuple[int, float, int, tuple[float, ...], float, float, str]


T = TypeVar("T")


class FairOrder(Generic[T]):
    """Yields pending items queue by queue in fair-share order, re-keying after each decision.

    ``head_key(item)`` gives the within-queue part (:data:`HeadKey`); ``queue_key(queue)`` the
    live part (below guarantee, share path), which ranks queues after the band and before the
    effective priority (see the module docstring). The heap is lazy: a popped entry whose key
    went stale is re-pushed instead of served.
    """

    def __init__(
        self,
        groups: dict[str, list[T]],
        head_key: Callable[[T], HeadKey],
        queue_key: Callable[[str], tuple[int, tuple[float, ...]]],
    ) -> None:
        self._groups = {q: sorted(items, key=head_key, reverse=True) for q, items in groups.items()}
        self._head_key = head_key
        self._queue_key = queue_key
        self._heap: list[tuple[OrderKey, str]] = []
        if len(self._groups) > 1:
            for q in self._groups:
                heapq.heappush(self._heap, (self._key(q), q))

    def _key(self, q: str) -> OrderKey:
        nominated, neg_band, neg_prio, arrival, job = self._head_key(self._groups[q][-1])
        below, shares = self._queue_key(q)
        return (nominated, neg_band, below, shares, neg_prio, arrival, job)

    def __iter__(self) -> Iterator[T]:
        if len(self._groups) == 1:
            # One queue: its own order alone, since the queue key only ranks queues against
            # each other (and costs a fair-share walk per item).
            [items] = self._groups.values()
            while items:
                yield items.pop()
            return
        while self._heap:
            key, q = heapq.heappop(self._heap)
            fresh = self._key(q)
            if fresh != key and self._heap and fresh > self._heap[0][0]:
                heapq.heappush(self._heap, (fresh, q))
                continue
            item = self._groups[q].pop()
            if self._groups[q]:
                heapq.heappush(self._heap, (self._key(q), q))
            yield item
