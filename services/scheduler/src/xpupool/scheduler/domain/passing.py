"""Placing new requests on arrival while jobs wait, exactly as a scheduling cycle would.

A job that waits is decided again by the scheduling cycles, in queue order, whenever capacity
frees up; a cycle that finds it still does not fit decides the jobs behind it on what is left
(and, once it has waited long, holds nodes for it so that they do not take its room:
``decide_batch``'s anti-starvation holds). So a new request need not wait for a cycle to be
decided that way: the scheduler decides it on arrival together with the jobs that wait, in the
same order and on the same pool a cycle would use, and places it when every waiting job still
waits. When one of them would now be placed, preempt or time out, nothing is placed on arrival
and a cycle does it all.

The waiting jobs are the ones a cycle read, the whole queue at one pending sequence
(``Ledger.waiting``; every job that starts waiting bumps it), and those this replica saw start
waiting right after. The admission script takes such a placement only while that sequence is
still the current one (``Admission.waiting_seq``): a job that started waiting since, which the
decision did not include, is never overtaken. With more than ``MAX_JUDGED`` jobs waiting, or a
preemption under way for one of them, new requests wait for the cycles as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from xpupool.scheduler.domain.config import SchedulerConfig
from xpupool.scheduler.domain.decide import Decision, PendingRequest, Wait

MAX_JUDGED = 16
"""The most waiting jobs decided again with every batch of arrivals (each costs a decision)."""


@dataclass(frozen=True)
class WaitingJudgement:
    """The jobs waiting at pending sequence ``seq``, as a cycle read them with ``config`` (all
    of them: a cycle that read only part of the queue makes none), the last ``added`` of them
    seen to start waiting since, one sequence number each."""

    seq: int
    config: SchedulerConfig
    waiting: tuple[PendingRequest, ...]
    added: int = 0

    def usable(self, config: SchedulerConfig) -> bool:
        """Whether arrivals decided with ``config`` may be placed past these jobs: the cycle's
        config, few enough jobs to decide again with every batch, and no preemption under way
        (a nominated job's victims are ending for it)."""
        return (
            config is self.config
            and len(self.waiting) <= MAX_JUDGED
            and not any(p.nominated for p in self.waiting)
        )

    def extended(self, pending: PendingRequest, seq: int) -> WaitingJudgement | None:
        """With ``pending`` waiting too, its wait having bumped the pending sequence to ``seq``;
        None when another job started waiting in between (one this replica does not know:
        only a cycle's read of the queue judges anew)."""
        if seq != self.seq + 1:
            return None
        return WaitingJudgement(seq, self.config, (*self.waiting, pending), self.added + 1)

    def since(self, seq: int) -> tuple[PendingRequest, ...] | None:
        """The jobs seen to start waiting after pending sequence ``seq``; None when that is not
        known (``seq`` is older than what this judgement followed, or newer than it)."""
        later = self.seq - seq
        if later < 0 or later > self.added:
            return None
        return self.waiting[len(self.waiting) - later :]


def judged_after_cycle(
    seq: int,
    config: SchedulerConfig,
    left: Sequence[PendingRequest],
    followed: WaitingJudgement | None,
) -> WaitingJudgement:
    """The judgement a cycle leaves: the jobs it left waiting, read at pending sequence
    ``seq``, and those the judgement followed meanwhile (``followed``) saw start waiting after
    that read, so that arrivals need not wait for another cycle to be placed past them."""
    later = followed.since(seq) if followed is not None else None
    if not later:
        return WaitingJudgement(seq, config, tuple(left))
    assert followed is not None
    return WaitingJudgement(followed.seq, config, (*left, *later), len(later))


def arrivals_past(
    decisions: Sequence[tuple[str, Decision]], waiting: Sequence[PendingRequest]
) -> list[tuple[str, Decision]] | None:
    """The arrivals' decisions out of a batch decided with the ``waiting`` jobs first (as a
    cycle orders them), when every waiting job still waits; None when one of them would now be
    placed, preempt or time out (a cycle's to do, and what it does changes what is left)."""
    waiting_ids = {p.request.job_id for p in waiting}
    if any(job_id in waiting_ids and not isinstance(d, Wait) for job_id, d in decisions):
        return None
    return [(job_id, d) for job_id, d in decisions if job_id not in waiting_ids]


def nominated(pending: PendingRequest) -> PendingRequest:
    """``pending`` with a preemption under way for it."""
    return replace(pending, nominated=True)


__all__ = [
    "MAX_JUDGED",
    "WaitingJudgement",
    "arrivals_past",
    "judged_after_cycle",
    "nominated",
]
