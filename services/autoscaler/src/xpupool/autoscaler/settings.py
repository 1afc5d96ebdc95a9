"""Autoscaler configuration (``XPUPOOL_*`` environment variables).

``XPUPOOL_POOLS_FILE`` names the pool file (YAML or TOML, see :mod:`xpupool.autoscaler.pools`);
the autoscaler's own knobs are ``XPUPOOL_AUTOSCALER_*``. Read with
``xpupool.obs.load_settings(AutoscalerSettings)``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


class AutoscalerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the autoscaler reads from its environment."""

    nats_url: str = "nats://127.0.0.1:4222"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Secured deployments (``xpupool.devstack.secure``): the NATS identity (an NKey seed file or
    # a NATS JWT .creds file), the CA that signed the servers' certificates, a client
    # certificate and key for mutual TLS, and the CA for a rediss:// ledger URL.
    nats_creds: str = ""
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    redis_tls_ca: str = ""
    namespace: str = "xpupool"
    log_level: str = "info"
    # The operator's pool file (YAML or TOML); re-read when it changes, the last good one kept.
    # Empty: no pools, the autoscaler decides nothing.
    pools_file: str = ""
    # How often the autoscaler decides (reads demand, plans, drives providers).
    autoscaler_interval_s: PositiveSeconds = 5.0
    # Demand history kept for the forecaster and for the scale-down watermark.
    autoscaler_history_s: PositiveSeconds = 7 * 24 * 3600.0
    # Width of one demand-history bucket (the forecaster's time step).
    autoscaler_bucket_s: PositiveSeconds = 300.0
    # The leader lease (one acting replica at a time): its term, renewed every third of it.
    autoscaler_leader_ttl_s: PositiveSeconds = 15.0
    # This replica's name in the leader lease; empty: host name and pid.
    autoscaler_replica_id: str = ""
    # Prometheus text on this port; 0 serves no metrics. Loopback unless told otherwise.
    autoscaler_metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    autoscaler_metrics_addr: str = "127.0.0.1"
    # A provider call (exec command, Kubernetes request) that takes longer fails.
    autoscaler_provider_timeout_s: PositiveSeconds = 120.0
    # Pending requests read from the ledger per cycle (oldest first).
    autoscaler_pending_limit: Annotated[int, msgspec.Meta(ge=1)] = 5000
    # A node that became ready this recently and holds no lease yet still counts as incoming
    # capacity: the scheduler needs a cycle to place the demand it was bought for.
    autoscaler_settle_s: Annotated[float, msgspec.Meta(ge=0)] = 15.0
    # The simulated provider's collectors run as telemetry-collectors, not as this replica: on
    # a secured stack, their identity (NATS credentials, Redis user) as a JSON object of
    # XPUPOOL_* variables laid over this replica's environment. Empty: this environment as is.
    autoscaler_collector_env: str = ""
    # A scale-up whose nodes are not all ready after 3 x the pool's provisioning delay plus
    # this fails (ScaleFailed) and is no longer counted as incoming.
    autoscaler_provisioning_grace_s: PositiveSeconds = 120.0
    # Failed provider calls of one step before it is given up (each one a ScaleFailed event).
    autoscaler_max_attempts: Annotated[int, msgspec.Meta(ge=1)] = 5
