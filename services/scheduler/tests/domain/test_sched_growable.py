"""Requests only the autoscaler's pools could hold wait (the autoscaler's demand) instead of
being rejected; what no pool could hold either is still rejected."""

from __future__ import annotations

from domain_builders import job, node, snapshot

from xpupool.contracts.payloads import GangSpec
from xpupool.scheduler.domain import Reason, Reject, Wait, decide_batch, default_config


def _one(request, growable=()):  # type: ignore[no-untyped-def]
    ((_, decision),) = decide_batch(
        [request], snapshot(node("t", "T4", 1)), default_config(), growable=growable
    )
    return decision


def test_only_pool_nodes_hold_it_so_it_waits() -> None:
    pool_nodes = tuple(node(f"a100#growable-{k}", "A100", 8) for k in range(2))
    a100 = job("a", models=["A100"])
    assert isinstance(_one(a100), Reject) and _one(a100).reason is Reason.UNKNOWN_MODEL
    waited = _one(a100, pool_nodes)
    assert isinstance(waited, Wait) and waited.reason is Reason.NO_MATCHING_DEVICE
    gang = job("g", count=8, gang=GangSpec(same_node=True))
    assert isinstance(_one(gang), Reject)
    waited = _one(gang, pool_nodes)
    assert isinstance(waited, Wait) and waited.reason is Reason.INSUFFICIENT_CAPACITY
    spread = job("s", count=12, gang=GangSpec(same_node=False))
    assert isinstance(_one(spread, pool_nodes), Wait)  # two 8-device nodes hold 12


def test_what_no_pool_could_hold_and_bad_requests_are_still_rejected() -> None:
    pool_nodes = (node("a100#growable-0", "A100", 8),)
    too_big = _one(job("b", count=9, gang=GangSpec(same_node=True)), pool_nodes)
    assert isinstance(too_big, Reject) and too_big.reason is Reason.EXCEEDS_NODE_CAPACITY
    bad = _one(job("q", priority="no-such-class"), pool_nodes)
    assert isinstance(bad, Reject) and bad.reason is Reason.UNKNOWN_PRIORITY
