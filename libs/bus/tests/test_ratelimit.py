"""The per-tenant query limit, on a clock of its own."""

from __future__ import annotations

import pytest

from xpupool.bus import ratelimit
from xpupool.bus.ratelimit import TenantRateLimit


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_is_served_then_the_rate() -> None:
    clock = _Clock()
    limit = TenantRateLimit(10.0, 5, clock=clock)
    assert [limit.admit("a") for _ in range(5)] == [0.0] * 5
    assert limit.admit("a") == pytest.approx(0.1)
    refusal = limit.refusal("a")
    assert refusal is not None and "retry in 0.10 s" in refusal
    clock.now += 0.1
    assert limit.admit("a") == 0.0
    assert limit.admit("a") > 0  # a refusal is not counted, a grant is


def test_one_tenant_at_its_limit_does_not_hold_another() -> None:
    limit = TenantRateLimit(1.0, 2, clock=_Clock())
    assert limit.admit("noisy") == limit.admit("noisy") == 0.0
    assert limit.admit("noisy") > 0
    assert limit.admit("quiet") == 0.0


def test_a_rate_of_zero_admits_everything() -> None:
    limit = TenantRateLimit(0.0, 1, clock=_Clock())
    assert all(limit.admit("a") == 0.0 for _ in range(1000))


def test_tenants_whose_bucket_is_full_again_are_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any subject token is a tenant on an insecure stack: what is remembered stays bounded."""
    monkeypatch.setattr(ratelimit, "FORGET_AFTER_TENANTS", 100)
    clock = _Clock()
    limit = TenantRateLimit(10.0, 1, clock=clock)
    for i in range(100):
        assert limit.admit(f"t{i}") == 0.0
    clock.now += 1.0  # every bucket full again
    assert limit.admit("busy") == 0.0
    assert limit.admit("new") == 0.0
    assert len(limit._arrivals) <= 2
    assert limit.admit("busy") > 0  # a tenant still within its interval is kept
