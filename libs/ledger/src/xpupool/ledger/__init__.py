"""The Redis device ledger: typed adapter, Lua transitions and the outbox relay."""

from xpupool.ledger.audit import audit
from xpupool.ledger.ledger import (
    ChangeCursor,
    DeviceRecord,
    HostClaim,
    JobRecord,
    LeaseRecord,
    Ledger,
    LedgerChanges,
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
    "ChangeCursor",
    "DeviceRecord",
    "HostClaim",
    "JobRecord",
    "Ledger",
    "LeaseRecord",
    "LedgerChanges",
    "NodeRecord",
    "OutboxRelay",
    "Reservation",
    "ScriptResult",
    "SliceClaim",
    "SliceMeta",
    "TakenSlice",
    "UsageClaim",
]
