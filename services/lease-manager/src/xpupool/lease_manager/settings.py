"""Lease-manager configuration (``XPUPOOL_*`` environment variables)."""

from __future__ import annotations

import msgspec


class LeaseManagerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the lease-manager reads from its environment."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "xpupool"
    log_level: str = "info"
    expiry_interval_s: float = 0.25
    node_grace_s: float = 15.0
    node_check_interval_s: float = 1.0
