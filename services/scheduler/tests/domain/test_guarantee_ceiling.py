"""A request that a queue which may not borrow (``over_quota: false``) could never hold."""

from __future__ import annotations

from domain_builders import job, node, snapshot

from xpupool.scheduler.domain import QueueConfig, Reason, Reject, Reserve, decide, default_config
from xpupool.scheduler.domain.config import with_queues


def test_a_request_beyond_the_guarantee_of_a_queue_that_may_not_borrow_is_rejected() -> None:
    """``over_quota: false`` makes the guarantee the queue's ceiling: a request larger than it
    can never be placed, even on an empty pool, so it is rejected (as one above a limit is)
    instead of waiting ``quota_exhausted`` for ever."""
    cfg = with_queues(
        default_config(), QueueConfig(name="A", guaranteed_units=2.0, over_quota=False)
    )
    d = decide(job("j", tenant="ta", queue="A", count=3), snapshot(node("n", "A100", 4)), cfg)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_QUOTA_LIMIT, d
    assert d.field == "count"
    fits = decide(job("k", tenant="ta", queue="A", count=2), snapshot(node("n", "A100", 4)), cfg)
    assert isinstance(fits, Reserve)


def test_a_model_guarantee_is_the_ceiling_of_a_parent_that_may_not_borrow() -> None:
    """The per-model guarantee decides for its model (``quota._within_guarantee``), here on the
    parent of the request's queue."""
    cfg = with_queues(
        default_config(),
        QueueConfig(name="P", guaranteed_devices={"A100": 1.0}, over_quota=False, children=("A",)),
        QueueConfig(name="A", parent="P"),
    )
    d = decide(job("j", tenant="ta", queue="A", count=2), snapshot(node("n", "A100", 4)), cfg)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_QUOTA_LIMIT, d
    half = decide(
        job("k", tenant="ta", queue="A", compute_pct=50), snapshot(node("n", "A100", 4)), cfg
    )
    assert isinstance(half, Reserve)
