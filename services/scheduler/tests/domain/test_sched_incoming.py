"""Capacity the autoscaler is provisioning: the jobs it is for wait ``capacity_incoming`` and
preempt nothing; the record of it ends with the nodes' readiness or when overdue."""

from __future__ import annotations

from datetime import UTC, datetime

from domain_builders import job, lease, node, snapshot

from xpupool.contracts import NodeProvisioning, NodeReady
from xpupool.placement.inventory import HostCharge
from xpupool.scheduler.domain import Preempt, Reason, Wait, decide_batch, default_config
from xpupool.scheduler.incoming import IncomingCapacity


def _full_pool():
    low = lease("l1", ["n1/0"], priority=100, started=100, host=(HostCharge("n1", 64_000, 0),))
    return snapshot(node("n1", "A100", 1), leases=(low,))


def test_a_job_incoming_nodes_will_serve_waits_for_them_instead_of_preempting() -> None:
    cfg = default_config()
    high = job("j", priority="high")
    ((_, plain),) = decide_batch([high], _full_pool(), cfg)
    assert isinstance(plain, Preempt), plain  # without incoming capacity it preempts
    ((_, waited),) = decide_batch([high], _full_pool(), cfg, incoming=frozenset({"j"}))
    assert isinstance(waited, Wait) and waited.reason is Reason.CAPACITY_INCOMING
    host = job("h", count=0, cpu_milli=8_000)
    ((_, host_wait),) = decide_batch([host], _full_pool(), cfg, incoming=frozenset({"h"}))
    assert isinstance(host_wait, Wait) and host_wait.reason is Reason.CAPACITY_INCOMING


def _at(s: float) -> datetime:
    return datetime.fromtimestamp(s, UTC)


def test_incoming_capacity_ends_when_every_node_is_ready_or_overdue() -> None:
    incoming = IncomingCapacity(overdue_s=600.0)
    incoming.provisioning(
        NodeProvisioning(
            request_id="r1",
            decision_id="d1",
            pool="a100",
            provider="simulated",
            count=2,
            job_ids=["j1", "j2"],
            expected_ready_at=_at(1_300.0),
            at=_at(1_000.0),
        )
    )
    incoming.provisioning(
        NodeProvisioning(
            request_id="r2",
            decision_id="d2",
            pool="t4",
            provider="simulated",
            count=1,
            job_ids=["j3"],
            at=_at(1_000.0),
        )
    )
    assert incoming.jobs(1_100.0) == {"j1", "j2", "j3"}
    incoming.ready(NodeReady(pool="a100", node_id="a100-0", request_id="r1", at=_at(1_200.0)))
    assert incoming.jobs(1_200.0) == {"j1", "j2", "j3"}
    incoming.ready(NodeReady(pool="a100", node_id="a100-1", request_id="r1", at=_at(1_250.0)))
    assert incoming.jobs(1_250.0) == {"j3"}
    assert incoming.jobs(1_601.0) == frozenset()  # r2 asked at 1,000 with no ready time: overdue
