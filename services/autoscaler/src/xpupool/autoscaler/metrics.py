"""The autoscaler's Prometheus metrics (its own registry, nothing on the process-wide one).

- ``xpupool_autoscaler_leader``: 1 on the replica that acts, 0 on the others;
- ``xpupool_autoscaler_pool_nodes{pool,state}``: nodes ready / provisioning / draining / lost;
- ``xpupool_autoscaler_pool_size_limit{pool,bound}``: ``min`` and ``max`` size;
- ``xpupool_autoscaler_pool_cost_per_hour{pool}``: what the pool's nodes cost now;
- ``xpupool_autoscaler_pending_demand_devices``: devices of the pending requests that more
  capacity would serve; ``xpupool_autoscaler_pending_jobs{kind}``: ``actionable`` / ``ignored``;
- ``xpupool_autoscaler_decisions_total{action,reason}``: decisions made (counter);
- ``xpupool_autoscaler_provider_failures_total{pool,action}``: provider calls that failed;
- ``xpupool_autoscaler_cycle_seconds``: how long a decision cycle takes (histogram).

Pool gauges are set by the acting replica only; a replica that stops acting clears them, so
summing over replicas counts every pool once.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from xpupool.autoscaler.status import ScaleStatus
from xpupool.obs.metrics import serve_metrics

__all__ = ["AutoscalerMetrics", "serve_metrics"]

NODE_STATES: Final = ("ready", "provisioning", "draining", "lost")


class AutoscalerMetrics:
    """Every series the autoscaler exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.leader = Gauge(
            "xpupool_autoscaler_leader", "1 if this replica is the acting leader", registry=r
        )
        self.pool_nodes = Gauge(
            "xpupool_autoscaler_pool_nodes",
            "Nodes of each pool by state",
            ("pool", "state"),
            registry=r,
        )
        self.pool_limit = Gauge(
            "xpupool_autoscaler_pool_size_limit",
            "A pool's configured min and max size",
            ("pool", "bound"),
            registry=r,
        )
        self.pool_cost = Gauge(
            "xpupool_autoscaler_pool_cost_per_hour",
            "What a pool's nodes (ready, provisioning, draining) cost per hour now",
            ("pool",),
            registry=r,
        )
        self.pending_devices = Gauge(
            "xpupool_autoscaler_pending_demand_devices",
            "Devices of the pending requests that more capacity would serve",
            registry=r,
        )
        self.pending_jobs = Gauge(
            "xpupool_autoscaler_pending_jobs",
            "Pending requests: actionable (capacity would serve them) or ignored",
            ("kind",),
            registry=r,
        )
        self.decisions = Counter(
            "xpupool_autoscaler_decisions",
            "Scale decisions made, by action and reason",
            ("action", "reason"),
            registry=r,
        )
        self.provider_failures = Counter(
            "xpupool_autoscaler_provider_failures",
            "Provider requests that failed (retried with the same request id)",
            ("pool", "action"),
            registry=r,
        )
        self.cycle_seconds = Histogram(
            "xpupool_autoscaler_cycle_seconds",
            "Duration of one decision cycle",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
        self._pools: set[str] = set()

    def observe(self, status: ScaleStatus) -> None:
        """Set the gauges from one cycle's status (the acting replica)."""
        self.leader.set(1)
        seen = set()
        for pool in status.pools:
            seen.add(pool.name)
            counts = {
                "ready": pool.ready,
                "provisioning": pool.provisioning,
                "draining": pool.draining,
                "lost": pool.lost,
            }
            for state in NODE_STATES:
                self.pool_nodes.labels(pool.name, state).set(counts[state])
            self.pool_limit.labels(pool.name, "min").set(pool.min_size)
            self.pool_limit.labels(pool.name, "max").set(pool.max_size)
            self.pool_cost.labels(pool.name).set(pool.cost_per_hour)
        for gone in self._pools - seen:
            self._forget(gone)
        self._pools = seen
        self.pending_devices.set(status.pending.actionable_devices)
        self.pending_jobs.labels("actionable").set(status.pending.actionable_jobs)
        self.pending_jobs.labels("ignored").set(sum(status.pending.ignored.values()))

    def follower(self) -> None:
        """This replica does not act: no pool series from it."""
        self.leader.set(0)
        for pool in self._pools:
            self._forget(pool)
        self._pools = set()
        self.pending_devices.set(0)
        for kind in ("actionable", "ignored"):
            self.pending_jobs.labels(kind).set(0)

    def _forget(self, pool: str) -> None:
        for state in NODE_STATES:
            self.pool_nodes.remove(pool, state)
        for bound in ("min", "max"):
            self.pool_limit.remove(pool, bound)
        self.pool_cost.remove(pool)
