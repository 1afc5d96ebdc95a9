"""The fixed vocabulary of reasons the scheduler gives for a pending, rejected or timed-out job.

The vocabulary is part of the public contract (``xpupool.contracts.JobReason``): the domain uses
the contract's enum itself, under the shorter name it has always had here.
"""

from __future__ import annotations

from xpupool.contracts import JobReason as Reason

__all__ = ["Reason"]
