"""Per-tenant request rate limits kept by one service replica (the tenant's queries).

A tenant's job requests are limited in the ledger, across replicas (``pend.lua``). Queries write
nothing and are answered by whichever replica takes them, so each replica limits what it is asked
itself: a tenant polling its lists in a tight loop is refused cheaply, before any Redis read,
instead of taking the event loop every other tenant's requests wait on.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic

FORGET_AFTER_TENANTS = 10_000
"""Past this many tenants remembered, those whose bucket is full again are forgotten (they would
be admitted as new anyway): on an insecure stack any subject token is a tenant."""


_CLOCK_ROUNDING_S = 1e-9
"""A wait this short is a float's rounding of a full bucket, not a refusal."""


class TenantRateLimit:
    """A token bucket per tenant (GCRA: each tenant's theoretical arrival time): ``rate_per_s``
    requests a second with ``burst`` of headroom; a rate of 0 or less admits everything."""

    def __init__(
        self, rate_per_s: float, burst: int, clock: Callable[[], float] = monotonic
    ) -> None:
        self.rate_per_s = rate_per_s
        self.burst = max(1, burst)
        self._clock = clock
        self._interval = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        self._arrivals: dict[str, float] = {}

    def admit(self, tenant: str) -> float:
        """0.0 when ``tenant`` may be served now (and the request is counted), else how many
        seconds until it may."""
        if self._interval <= 0:
            return 0.0
        now = self._clock()
        arrival = max(self._arrivals.get(tenant, now), now) + self._interval
        wait = arrival - now - self._interval * self.burst
        if wait > _CLOCK_ROUNDING_S:
            return wait
        if tenant not in self._arrivals and len(self._arrivals) >= FORGET_AFTER_TENANTS:
            self._forget_full(now)
        self._arrivals[tenant] = arrival
        return 0.0

    def refusal(self, tenant: str) -> str | None:
        """None when ``tenant`` may be served now (``admit``), else what it is told."""
        wait_s = self.admit(tenant)
        if not wait_s:
            return None
        return (
            f"over {self.rate_per_s:g} queries/s (burst {self.burst}) for this tenant; "
            f"retry in {wait_s:.2f} s"
        )

    def _forget_full(self, now: float) -> None:
        self._arrivals = {t: a for t, a in self._arrivals.items() if a > now}
