"""The Redis device ledger: typed adapter, Lua transitions and the outbox relay."""

from xpupool.ledger.audit import audit
from xpupool.ledger.ledger import (
    AdmissionLimits,
    ChangeCursor,
    DeviceRecord,
    FairShareView,
    Holder,
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
    new_lease_secret,
    open_ledger,
)
from xpupool.ledger.outbox import OutboxRelay

__all__ = [
    "audit",
    "new_lease_secret",
    "open_ledger",
    "AdmissionLimits",
    "Holder",
    "ChangeCursor",
    "DeviceRecord",
    "FairShareView",
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
