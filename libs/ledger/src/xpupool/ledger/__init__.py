"""The Redis device ledger: typed adapter, Lua transitions and the outbox relay."""

from xpupool.ledger.ledger import (
    DeviceRecord,
    HostClaim,
    JobRecord,
    Ledger,
    LeaseRecord,
    NodeRecord,
    Reservation,
    ScriptResult,
    SliceClaim,
    TakenSlice,
    UsageClaim,
)
from xpupool.ledger.outbox import OutboxRelay

__all__ = [
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
    "TakenSlice",
    "UsageClaim",
]
