"""Lease-manager configuration (``XPUPOOL_*`` environment variables)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from xpupool.ledger.ledger import DEFAULT_RETENTION_S


class LeaseManagerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the lease-manager reads from its environment."""

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
    # Failpoints armed in this process (``xpupool.obs.failpoints``): for fault tests only.
    failpoints: str = ""
    expiry_interval_s: float = 0.25
    # How long before its maximum run time a lease's holder is warned (LeaseEnding).
    max_runtime_warning_s: float = 60.0
    # How long an idle lease's holder is warned before the lease is reclaimed (idle_reclaim_s).
    idle_warning_s: float = 60.0
    # How long ended leases' usage records are kept (xpupool usage reads them), and how often
    # older ones are trimmed.
    usage_retention_s: Annotated[float, msgspec.Meta(gt=0)] = 90 * 24 * 3600.0
    usage_trim_interval_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # How long the ledger keeps an ended job's record (a resubmission of its id is refused as a
    # duplicate that long) and an ended lease's (lease.get answers for it that long), written to
    # the ledger at start (Ledger.set_retention). At least an hour: an outbox entry about a lease
    # is published from its record, so the lease's must outlast any NATS outage to ride out.
    job_retention_s: Annotated[int, msgspec.Meta(ge=3600)] = DEFAULT_RETENTION_S
    lease_retention_s: Annotated[int, msgspec.Meta(ge=3600)] = DEFAULT_RETENTION_S
    node_grace_s: float = 15.0
    # A lease ended lost with its node may still run (a partition, not a crash): its devices take
    # no grant until its term ends plus this, the time ``xpupool run`` gives its job to stop
    # after SIGTERM (its ``grace_s``).
    lost_holder_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    node_check_interval_s: float = 1.0
    # Prometheus text on this port (deployments use 9402); 0 serves no metrics. Loopback unless
    # a deployment sets the address (e.g. 0.0.0.0 in a pod). Prefixed like the autoscaler's so a
    # devstack's shared environment can give every service its own port.
    lease_manager_metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    lease_manager_metrics_addr: str = "127.0.0.1"
    # How often the lease gauges are re-read from the ledger (on the event loop, not per scrape).
    lease_manager_metrics_refresh_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # Each tenant's queries (its job and lease lists, a lease by id) this replica answers, a
    # token bucket per tenant; more are refused ``rate_limited`` before any ledger read. 0: none.
    # Room for a client polling every 5 ms; a loop that polls without pausing is held to it.
    query_rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 200.0
    query_burst: Annotated[int, msgspec.Meta(ge=1)] = 400
