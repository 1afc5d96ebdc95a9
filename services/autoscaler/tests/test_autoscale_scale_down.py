"""Scale-down: cool-down, hysteresis (low watermark), min size, drain policies, demand back."""

from __future__ import annotations

from autoscale_builders import make_pool

from xpupool.autoscaler.scale_down import NodeStatus, PoolLoad, peak_busy, plan_scale_down
from xpupool.contracts import ScaleAction, ScaleReason

NOW = 100_000.0
COOL = 600.0


def idle(node_id: str, for_s: float, **kw: object) -> NodeStatus:
    return NodeStatus(node_id=node_id, idle_since=NOW - for_s, **kw)  # type: ignore[arg-type]


def busy(node_id: str) -> NodeStatus:
    return NodeStatus(node_id=node_id, idle_since=None, lease_ids=("l-" + node_id,))


def actions(steps: tuple[object, ...]) -> dict[ScaleAction, tuple[str, ...]]:
    return {s.action: s.node_ids for s in steps}  # type: ignore[attr-defined]


def test_nodes_idle_past_the_cool_down_are_drained_longest_idle_first() -> None:
    pool = make_pool(scale_down={"cooldown_s": COOL})
    nodes = [idle("n1", 700), idle("n2", 5000), idle("n3", 601), busy("n4")]
    (step,) = plan_scale_down(pool, nodes, PoolLoad(recent_peak_busy=0), NOW)
    assert step.action is ScaleAction.DRAIN and step.reason is ScaleReason.IDLE
    assert step.node_ids == ("n2", "n1", "n3")
    assert "idle at least 600 s" in step.detail


def test_a_short_lull_removes_nothing() -> None:
    """Idle for less than the cool-down: not a candidate, whatever the watermark says."""
    pool = make_pool(scale_down={"cooldown_s": COOL})
    nodes = [idle("n1", 599), idle("n2", 30), busy("n3")]
    assert plan_scale_down(pool, nodes, PoolLoad(recent_peak_busy=0), NOW) == ()


def test_hysteresis_keeps_the_recent_peak_plus_headroom() -> None:
    """Ten idle nodes, but three were busy at once within the window: with a 0.7 watermark the
    pool keeps five (3 <= 0.7 * 5), so the next burst like the last finds its nodes."""
    pool = make_pool(scale_down={"cooldown_s": COOL, "low_watermark": 0.7})
    nodes = [idle(f"n{i:02d}", 1000 + i) for i in range(10)]
    (step,) = plan_scale_down(pool, nodes, PoolLoad(recent_peak_busy=3), NOW)
    assert len(step.node_ids) == 5 and "5 left" in step.detail
    # The peak reaching the whole pool drains nothing.
    assert plan_scale_down(pool, nodes, PoolLoad(recent_peak_busy=10), NOW) == ()


def test_never_below_min_size_provisioning_nodes_included() -> None:
    pool = make_pool(min_size=2, scale_down={"cooldown_s": COOL})
    nodes = [idle("n1", 9000), idle("n2", 9000), idle("n3", 9000)]
    (step,) = plan_scale_down(pool, nodes, PoolLoad(), NOW)
    assert step.node_ids == ("n1",)
    # A node being provisioned (not named yet) counts toward the size: two idle ones may go.
    (step,) = plan_scale_down(pool, nodes, PoolLoad(), NOW, provisioning=1)
    assert step.node_ids == ("n1", "n2")
    # Not-ready nodes are never drained (they are not idle, they are starting).
    starting = [NodeStatus(node_id="s1", idle_since=NOW - 9000, ready=False)]
    loose = make_pool(scale_down={"cooldown_s": COOL})
    assert plan_scale_down(loose, starting, PoolLoad(), NOW) == ()


def test_drained_nodes_are_removed_only_when_no_lease_remains() -> None:
    pool = make_pool(scale_down={"cooldown_s": COOL})
    nodes = [
        NodeStatus(node_id="d1", draining_since=NOW - 50),
        NodeStatus(node_id="d2", draining_since=NOW - 40, lease_ids=("l1",)),
    ]
    steps = plan_scale_down(pool, nodes, PoolLoad(), NOW)
    assert actions(steps) == {ScaleAction.REMOVE: ("d1",)}  # wait policy: d2 waits
    assert steps[0].reason is ScaleReason.DRAINED


def test_preempt_policy_preempts_the_leases_left_once_with_the_grace() -> None:
    pool = make_pool(drain={"policy": "preempt", "grace_s": 90})
    holding = NodeStatus(node_id="d2", draining_since=NOW - 40, lease_ids=("l1", "l2"))
    (step,) = plan_scale_down(pool, [holding], PoolLoad(), NOW)
    assert step.action is ScaleAction.PREEMPT and step.reason is ScaleReason.DRAIN_GRACE
    assert step.lease_ids == ("l1", "l2") and step.grace_s == 90 and step.node_ids == ("d2",)
    asked = NodeStatus(
        node_id="d2", draining_since=NOW - 40, lease_ids=("l1",), preempt_requested=True
    )
    assert plan_scale_down(pool, [asked], PoolLoad(), NOW) == ()  # asked once: now it waits


def test_demand_back_undrains_and_stops_every_removal() -> None:
    pool = make_pool(scale_down={"cooldown_s": COOL})
    nodes = [
        NodeStatus(node_id="d1", draining_since=NOW - 50),
        NodeStatus(node_id="d0", draining_since=NOW - 80),
        idle("n1", 9000),
    ]
    (step,) = plan_scale_down(pool, nodes, PoolLoad(pending_jobs=("j1", "j2")), NOW)
    assert step.action is ScaleAction.UNDRAIN and step.reason is ScaleReason.DEMAND_RETURNED
    assert step.node_ids == ("d0", "d1") and step.demand.job_ids == ("j1", "j2")
    assert plan_scale_down(pool, [idle("n1", 9000)], PoolLoad(pending_jobs=("j",)), NOW) == ()


def test_peak_busy_reads_only_the_window() -> None:
    history = [(NOW - 2000, 9), (NOW - 500, 3), (NOW - 100, 1), (NOW + 10, 50)]
    assert peak_busy(history, NOW, 600) == 3
    assert peak_busy(history, NOW, 3000) == 9
    assert peak_busy([], NOW, 600) == 0


def test_a_predictive_pool_keeps_what_its_forecast_wants() -> None:
    """Four nodes idle past the cool-down, no recent peak: a reactive pool drains all four. A
    predictive pool whose forecast wants three at the provisioning horizon drains one: the
    three would be added again at the next cycle (the forecast sees only ready and provisioning
    nodes), a churn of one node's provisioning and cool-down after another."""
    pool = make_pool(predictive={"enabled": True}, scale_down={"cooldown_s": COOL})
    nodes = [idle(f"n{i}", 1000 + i) for i in range(4)]
    (step,) = plan_scale_down(pool, nodes, PoolLoad(), NOW)
    assert len(step.node_ids) == 4
    (step,) = plan_scale_down(pool, nodes, PoolLoad(), NOW, keep_nodes=3)
    assert step.node_ids == ("n3",)
    assert plan_scale_down(pool, nodes, PoolLoad(), NOW, keep_nodes=4) == ()
