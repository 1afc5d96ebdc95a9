"""The Redis device ledger: typed adapter, Lua transitions and the outbox relay."""

from xpupool.ledger.audit import audit
from xpupool.ledger.ledger import (
    DeviceRecord,
    HostClaim,
    JobRecord,
    LeaseRecord,
    Ledger,
    NodeRecord,
    Reservation,
    ScriptResult,
    SliceClaim,
    SliceMeta,
    TakenSlice,
    UsageClaim,
    open_ledger,
)
from xpupool.ledger.outbox import OutboxRelay

__all__ = [
    "audit",
    "open_ledger",
    "DeviceRecord",
    "HostClaim",
    "JobRecord",
    "Ledger",
    "LeaseRecord",
    "NodeRecord",
    "OutboxRelay",
    "Reservation",
    "ScriptResult",
    "SliceClaim",
    "SliceMeta",
    "TakenSlice",
    "UsageClaim",
]
