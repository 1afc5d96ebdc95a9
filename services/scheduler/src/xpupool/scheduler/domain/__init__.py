"""Pure scheduling decisions for xpupool: state in, decisions out (no I/O, no asyncio).

The shell builds a :class:`PoolSnapshot` from the ledger and calls :func:`decide_batch`; see
:mod:`.decide` for what to do with each decision, :mod:`.config` for the operator's file,
:mod:`.fairshare` for ordering and anti-starvation, :mod:`.quota` for quotas and reclaim,
:mod:`.preemption` for victim choice and :mod:`.placement` for the pluggable policies.
"""

from xpupool.placement.default import default_registry
from xpupool.placement.engine import (
    LearningPolicy,
    NodeScorer,
    PlacementPolicy,
    PolicyRegistry,
    PoolPlacementPolicy,
    ScoredPolicy,
)
from xpupool.placement.inventory import (
    DeviceState,
    HostCharge,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)
from xpupool.placement.pool import WorkingPool
from xpupool.scheduler.domain.config import (
    ConfigError,
    QueueConfig,
    SchedulerConfig,
    default_config,
    load_config,
    parse_config,
)
from xpupool.scheduler.domain.decide import (
    Decision,
    PendingRequest,
    Preempt,
    Reject,
    Reserve,
    TimedOut,
    Wait,
    apply_decision,
    decide,
    decide_batch,
)
from xpupool.scheduler.domain.fairshare import FairShareHistory, current_usage, update_history
from xpupool.scheduler.domain.matching import Rejection, never_fits
from xpupool.scheduler.domain.quota import QueueStatus, queue_status
from xpupool.scheduler.domain.reasons import Reason

__all__ = [
    "ConfigError",
    "Decision",
    "DeviceState",
    "FairShareHistory",
    "HostCharge",
    "LeaseSlice",
    "LeaseState",
    "NodeScorer",
    "NodeState",
    "PendingRequest",
    "PlacementPolicy",
    "PolicyRegistry",
    "LearningPolicy",
    "PoolPlacementPolicy",
    "PoolSnapshot",
    "Preempt",
    "QueueConfig",
    "QueueStatus",
    "Reason",
    "Reject",
    "Rejection",
    "Reserve",
    "SchedulerConfig",
    "ScoredPolicy",
    "TimedOut",
    "Wait",
    "WorkingPool",
    "apply_decision",
    "current_usage",
    "decide",
    "decide_batch",
    "default_config",
    "default_registry",
    "load_config",
    "never_fits",
    "parse_config",
    "queue_status",
    "update_history",
]
