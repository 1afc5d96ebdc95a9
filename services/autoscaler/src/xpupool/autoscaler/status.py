"""What ``xpupool scale status`` shows: the leader's snapshot, written to the ledger each cycle.

The acting replica writes one :class:`ScaleStatus` (JSON) to ``{<namespace>}:autoscaler:status``
at the end of every cycle; the CLI reads it from Redis, so it needs no running autoscaler to
answer and says how old the snapshot is. :func:`render` is the text form.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from xpupool.contracts import ScaleDecision

__all__ = [
    "IncomingRequest",
    "NodeView",
    "PendingView",
    "PoolStatus",
    "ScaleStatus",
    "decode_status",
    "render",
]


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a pool: ``state`` is ready, provisioning, draining or lost."""

    node_id: str
    state: str
    leases: int = 0
    request_id: str | None = None
    idle_since: float | None = None
    draining_since: float | None = None


class IncomingRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A scale-up whose nodes are not all ready yet."""

    request_id: str
    count: int
    ready: int
    node_ids: list[str] = msgspec.field(default_factory=list)
    requested_at: float
    expected_ready_at: float | None = None
    attempts: int = 0
    last_error: str = ""


class PoolStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One pool: its limits, sizes, cost now, the demand attributed to it, nodes coming and
    going."""

    name: str
    provider: str
    model: str
    devices_per_node: int
    min_size: int
    max_size: int
    ready: int
    provisioning: int
    draining: int
    lost: int = 0
    node_cost_per_hour: float
    cost_per_hour: float
    pending_jobs: int = 0
    pending_devices: float = 0.0
    predictive: bool = False
    forecast_devices: float | None = None
    incoming: list[IncomingRequest] = msgspec.field(default_factory=list)
    nodes: list[NodeView] = msgspec.field(default_factory=list)
    provider_error: str = ""


class PendingView(msgspec.Struct, frozen=True, kw_only=True):
    """The ledger's pending requests as the autoscaler read them: those more capacity would
    serve (``actionable``), the others counted by reason, and why some get no node."""

    jobs: int = 0
    actionable_jobs: int = 0
    actionable_devices: float = 0.0
    ignored: dict[str, int] = msgspec.field(default_factory=dict)
    unserved: dict[str, str] = msgspec.field(default_factory=dict)


class ScaleStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The leader's view at the end of one cycle."""

    leader: str
    term: int
    at: float
    interval_s: float
    pools: list[PoolStatus] = msgspec.field(default_factory=list)
    pending: PendingView = msgspec.field(default_factory=PendingView)
    cost_per_hour: float = 0.0
    recent_decisions: list[ScaleDecision] = msgspec.field(default_factory=list)
    pools_source: str = ""
    pools_error: str = ""


_DECODER = msgspec.json.Decoder(ScaleStatus)


def decode_status(raw: bytes) -> ScaleStatus:
    """Read a status snapshot (``msgspec.DecodeError`` if it is not one)."""
    return _DECODER.decode(raw)


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S")


def render(status: ScaleStatus, now: float) -> str:
    """The text ``xpupool scale status`` prints."""
    age = max(0.0, now - status.at)
    stale = age > 3 * status.interval_s + 5
    lines = [
        f"autoscaler {status.leader} (term {status.term}), cycle at {_when(status.at)} UTC, "
        f"{age:.0f} s ago{' (STALE: is the autoscaler running?)' if stale else ''}",
        f"pools from {status.pools_source or '(no pool file)'}"
        + (f"; last reload refused: {status.pools_error}" if status.pools_error else ""),
        f"cost {status.cost_per_hour:.2f}/h; pending: {status.pending.jobs} jobs, "
        f"{status.pending.actionable_jobs} that capacity would serve "
        f"({status.pending.actionable_devices:g} devices)",
    ]
    if status.pending.ignored:
        ignored = ", ".join(f"{n} {r}" for r, n in sorted(status.pending.ignored.items()))
        lines.append(f"  not for more capacity: {ignored}")
    for job_id, why in list(status.pending.unserved.items())[:10]:
        lines.append(f"  no node for {job_id}: {why}")
    if not status.pools:
        lines.append("no pools configured")
    header = (
        f"{'POOL':<16} {'PROVIDER':<10} {'NODE':<22} {'MIN':>3} {'MAX':>3} {'READY':>5} "
        f"{'PROV':>4} {'DRAIN':>5} {'PENDING':>7} {'COST/H':>9}"
    )
    if status.pools:
        lines.append(header)
    for pool in status.pools:
        shape = f"{pool.devices_per_node}x{pool.model}"
        lines.append(
            f"{pool.name:<16} {pool.provider:<10} {shape[:22]:<22} {pool.min_size:>3} "
            f"{pool.max_size:>3} {pool.ready:>5} {pool.provisioning:>4} {pool.draining:>5} "
            f"{pool.pending_jobs:>7} {pool.cost_per_hour:>9.2f}"
        )
        for request in pool.incoming:
            eta = (
                f", expected ready {_when(request.expected_ready_at)}"
                if request.expected_ready_at
                else ""
            )
            error = f", last error: {request.last_error}" if request.last_error else ""
            names = f" ({', '.join(request.node_ids)})" if request.node_ids else ""
            lines.append(
                f"  coming: {request.count - request.ready} of {request.count} nodes{names} "
                f"for {request.request_id}{eta}{error}"
            )
        for node in pool.nodes:
            if node.state == "draining":
                lines.append(f"  going: {node.node_id} draining, {node.leases} leases left")
            elif node.state == "lost":
                lines.append(f"  lost: {node.node_id} (no heartbeat)")
        if pool.forecast_devices is not None:
            lines.append(f"  forecast: {pool.forecast_devices:g} devices at the horizon")
        if pool.provider_error:
            lines.append(f"  provider: {pool.provider_error}")
    if status.recent_decisions:
        lines.append("recent decisions:")
        for d in status.recent_decisions[-10:]:
            lines.append(
                f"  {_when(d.at.timestamp())} {d.pool} {d.action.value} {d.count} "
                f"({d.reason.value}) {d.size_before}->{d.size_after}: {d.detail}"
            )
    return "\n".join(lines)
