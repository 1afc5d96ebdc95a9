"""Scheduler configuration (``XPUPOOL_*`` environment variables)."""

from __future__ import annotations

from typing import Annotated

import msgspec


class SchedulerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the scheduler reads from its environment."""

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
    # Grant a reservation in the script that makes it (the lease is active at once and the
    # lease-manager announces it), rather than leaving it to the lease-manager's grant consumer:
    # two hops and two ledger round trips fewer per grant. Off: reserve, then the lease-manager
    # grants (a reservation it never takes up is taken back after reservation_hold_s).
    grant_at_reserve: bool = True
    # Place new requests on arrival while no job waits: decided together and granted in their
    # admission script (one ledger step, no cycle), else admitted to the pending queue. Needs
    # grant_at_reserve. Off: every request waits for a scheduling cycle.
    place_on_admission: bool = True
    # A lone arrival is placed on the copy of the ledger kept from the last read, without
    # reading first, while the ledger's change feed announced nothing since; the ledger checks
    # that it still shows that view when it grants. Off: every admission reads the change log.
    decide_on_kept_copy: bool = True
    # How long a reservation waits for the lease-manager before the ledger takes it back.
    reservation_hold_s: float = 60.0
    # Pending requests are retried on every capacity event and at least this often.
    retry_interval_s: float = 1.0
    # The most pending requests one cycle decides (the rest wait for the next cycle).
    batch_limit: int = 2000
    # Queue tree, priorities and policies (YAML or TOML); reloaded when the file changes.
    queue_config: str = ""
    # The trace policies (``<name>-trace``, see ``trace_policies``): the pod list CSV they expect
    # (FGD and ``xpupool-static-trace`` need it), ledger model -> workload model names
    # (``V100-SXM2-16GB=V100M16,...``) and the random policy's seed.
    placement_workload: str = ""
    placement_model_aliases: str = ""
    placement_seed: int = 0
    # The default policy learns the request shapes over a window of this many requests (the
    # weight of a request halves after this many newer ones).
    placement_shape_half_life: float = 5000.0
    # Prometheus text on this port (deployments use 9401); 0 serves no metrics. Loopback unless
    # a deployment sets the address (e.g. 0.0.0.0 in a pod). Prefixed like the autoscaler's so a
    # devstack's shared environment can give every service its own port.
    scheduler_metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    scheduler_metrics_addr: str = "127.0.0.1"
    # How often the pool gauges are re-read from the ledger (on the event loop, not per scrape).
    scheduler_metrics_refresh_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # Each tenant's queries (its job and lease lists, a lease by id) this replica answers, a
    # token bucket per tenant; more are refused ``rate_limited`` before any ledger read. 0: none.
    # Room for a client polling every 5 ms; a loop that polls without pausing is held to it.
    query_rate_per_s: Annotated[float, msgspec.Meta(ge=0)] = 200.0
    query_burst: Annotated[int, msgspec.Meta(ge=1)] = 400
