"""The fixed vocabulary of reasons the scheduler gives for a pending, rejected or timed-out job.

The lead publishes these strings in ``JobPending.reason`` / ``JobRejected.reason`` and
``xpupool explain JOB`` shows them, so values are part of the public API: add, never rename.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Reason"]


class Reason(StrEnum):
    """Why a job waits, was rejected or timed out."""

    # --- pending (Wait) -------------------------------------------------------------------
    NO_MATCHING_DEVICE = "no_matching_device"
    """No healthy device matches the selectors right now (or, when rejecting, none at all)."""
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    """Matching devices exist but not enough of them are free."""
    QUOTA_EXHAUSTED = "quota_exhausted"
    """It would fit, but the queue (or an ancestor) is at its limit, or at its guarantee with
    borrowing disabled."""
    WAITING_FOR_GANG = "waiting_for_gang"
    """Some of the gang's devices could be placed now, but not all of them together."""
    PREEMPTION_IN_PROGRESS = "preemption_in_progress"
    """Leases were preempted for this job and are still ending."""
    CAPACITY_INCOMING = "capacity_incoming"
    """It will fit once leases that are already ending give their slices back."""
    CAPACITY_RESERVED = "capacity_reserved"
    """It fits only on nodes held for a job that has waited too long (anti-starvation)."""

    # --- rejected (Reject), terminal ------------------------------------------------------
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_DEVICE = "unknown_device"
    UNKNOWN_QUEUE = "unknown_queue"
    UNKNOWN_PRIORITY = "unknown_priority"
    SHARE_TOO_LARGE = "share_too_large"
    EXCEEDS_NODE_CAPACITY = "exceeds_node_capacity"
    EXCEEDS_DOMAIN_CAPACITY = "exceeds_domain_capacity"
    EXCEEDS_POOL_CAPACITY = "exceeds_pool_capacity"
    EXCEEDS_QUOTA_LIMIT = "exceeds_quota_limit"

    # --- timed out (TimedOut), terminal ---------------------------------------------------
    MAX_WAIT_EXCEEDED = "max_wait_exceeded"
