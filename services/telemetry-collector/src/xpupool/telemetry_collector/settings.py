"""Collector configuration (``XPUPOOL_*`` environment variables)."""

from __future__ import annotations

import os
import re
import socket
from typing import Annotated

import msgspec

NodeId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def _default_node_id() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:64] or "node"


class CollectorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the collector reads from its environment."""

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
    # A subject token, so letters, digits, '-' and '_' only.
    node_id: NodeId = msgspec.field(default_factory=_default_node_id)
    # "simulated" (needs node_profile), or a vendor backend: nvml, npu-smi, cnmon, rocm-smi.
    backend: str = "simulated"
    node_profile: str = "2xA100-80GB"
    catalog: str = ""
    # Which per-process share limits run on this node (xpupool.devices.enforcement): "auto"
    # (a real node: MPS when its control daemon answers; a simulated one: the catalog's),
    # "catalog", "none", or a comma list of mps and hami-core.
    share_limits: str = "auto"
    seed: int = 0
    sample_interval_s: float = 1.0
    # Consecutive ticks without a sample before a device counts as lost.
    missed_samples_lost: int = 3
    # How often a tick reads the devices whole (discover: more tool calls than a sample on
    # some backends) to find a unit changed under the same id, e.g. a MIG instance made again.
    spec_check_interval_s: float = 30.0
    cpu_milli: int = msgspec.field(default_factory=lambda: (os.cpu_count() or 1) * 1000)
    memory_mib: int = 0
    # Prometheus text on this port (deployments use 9400, dcgm-exporter's); 0 serves no
    # metrics. Loopback unless a deployment sets the address (e.g. 0.0.0.0 in a pod).
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    metrics_addr: str = "127.0.0.1"
    # Device labels in dcgm-exporter's camelCase (UUID, modelName, Hostname) instead of
    # snake_case; promtool's lint flags them, so only for dashboards that need them.
    metrics_dcgm_labels: bool = False
    # Added to every grant before a lease counts as over-using (driver and context overhead).
    overuse_tolerance_mib: int = 0
    # Simulated devices report the memory leased on them times this factor; above 1 every
    # share lease over-uses (demos and tests of over-use detection).
    sim_overuse_factor: float = 1.0
    # Simulated devices are as busy as leased times this factor; 0 makes every lease idle
    # (demos and tests of idle reclaim).
    sim_busy_factor: float = 1.0
