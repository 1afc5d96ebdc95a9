"""Pools for the autoscaler's unit tests."""

from __future__ import annotations

from typing import Any

from xpupool.autoscaler.pools import PoolConfig, parse_pools
from xpupool.devices.catalog import load_catalog

CATALOG = load_catalog()


def make_pool(name: str = "a100", **overrides: Any) -> PoolConfig:
    entry: dict[str, Any] = {
        "name": name,
        "node": {"model": "A100-SXM4-80GB", "count": 8, "cpu_milli": 96000},
        "cost_per_hour": 16.0,
        "max_size": 10,
        "provider": {"type": "simulated"},
    }
    entry.update(overrides)
    return parse_pools({"pools": [entry]}, catalog=CATALOG).pools[0]
