"""Selectors, shares and never-fits rejection."""

from __future__ import annotations

from dataclasses import replace

from domain_builders import job, node, snapshot

from xpupool.contracts.payloads import GangSpec, Isolation, Vendor
from xpupool.placement.demand import share_on
from xpupool.scheduler.domain import (
    QueueConfig,
    Reason,
    Reject,
    Reserve,
    Wait,
    WorkingPool,
    decide,
    default_config,
    never_fits,
)
from xpupool.scheduler.domain.config import with_queues


def mixed():
    return snapshot(
        node("t4", "T4", 4),
        node("a100", "A100", 8),
        node("asc", "910B", 8),
        node("mig", "A100-MIG-3g.40gb", 2),
        node("mlu", "MLU370", 4),
    )


def models_of(d) -> set[str]:
    assert isinstance(d, Reserve), d
    return {s.model for s in d.slices}


def test_vendor_selector_restricts_to_vendor():
    """A vendor selector only places on that vendor's devices."""
    assert models_of(decide(job("j", vendor=Vendor.ASCEND), mixed())) == {"910B"}


def test_models_and_avoid_models():
    """`models` restricts to listed models and `avoid_models` removes models from the choice."""
    assert models_of(decide(job("j", models=["a100"]), mixed())) == {"A100"}
    assert models_of(decide(job("j", avoid_models=["T4"]), mixed())) == {"MLU370"}


def test_device_ids_and_avoid_device_ids():
    """`device_ids` pins to the named devices (id or uuid); `avoid_device_ids` skips them."""
    d = decide(job("j", device_ids=["uuid-a100-3"]), mixed())
    assert isinstance(d, Reserve) and d.slices[0].device_id == "a100/3"
    d = decide(
        job("j", vendor=Vendor.NVIDIA, models=["T4"], avoid_device_ids=["t4/0", "t4/1"]), mixed()
    )
    assert isinstance(d, Reserve) and d.slices[0].device_id in {"t4/2", "t4/3"}


def test_min_memory_and_min_capacity():
    """Minimum visible memory and minimum normalized capacity filter device classes."""
    assert models_of(decide(job("j", min_memory_mib=70000), mixed())) == {"A100"}
    assert models_of(decide(job("j", min_capacity=0.5), mixed())) == {"910B"}


def test_capabilities_exclude_t4_for_bf16():
    """A bf16 requirement keeps the job off T4 (no BF16) even though T4 is the cheapest."""
    assert models_of(decide(job("j"), mixed())) == {"T4"}
    assert models_of(decide(job("j", capabilities=["BF16"]), mixed())) == {"MLU370"}


def test_hard_isolation_kept_off_soft_shared_devices():
    """A share with isolation=hard lands only on a hardware partition (MIG instance, vNPU),
    never as a hami-core/MPS share: a pool without partitions has no device for it."""
    snap = snapshot(node("t4", "T4", 2), node("a100", "A100", 2), node("asc", "910B", 2))
    d = decide(job("j", memory_mib=8000, isolation=Isolation.HARD), snap)
    assert isinstance(d, Reject) and d.reason is Reason.NO_MATCHING_DEVICE
    d = decide(job("j", memory_mib=8000, isolation=Isolation.HARD, vendor=Vendor.NVIDIA), snap)
    assert isinstance(d, Reject) and d.reason is Reason.NO_MATCHING_DEVICE


def test_hard_nvidia_share_is_the_smallest_mig_instance_that_holds_it_taken_whole():
    """MPS and HAMi-core limits are not hard: a hard NVIDIA share is a MIG instance, whole, the
    smallest that holds it (cheapest intent); a MIG-capable GPU not in MIG mode offers none; the
    grant says its slice is enforced, and an MPS share says so too while a Cambricon share does
    not."""
    small = node("m1", "A100-MIG-3g.40gb", 1)
    small = replace(
        small,
        devices=tuple(
            replace(
                d,
                memory_total_mib=19968,
                memory_free_mib=19968,
                capacity_units=0.28,
                cost_per_hour=0.9,
                uuid="MIG-small",
            )
            for d in small.devices
        ),
    )
    snap = snapshot(node("a100", "A100", 2), node("m3", "A100-MIG-3g.40gb", 1), small)
    d = decide(job("j", memory_mib=8000, isolation=Isolation.HARD), snap)
    assert isinstance(d, Reserve), d
    (s,) = d.slices
    assert s.device_id == "m1/0" and s.whole and s.enforced and s.memory_mib == 19968
    d = decide(job("j", memory_mib=30000, isolation=Isolation.HARD), snap)
    assert isinstance(d, Reserve) and d.slices[0].device_id == "m3/0" and d.slices[0].whole
    d = decide(job("j", memory_mib=50000, isolation=Isolation.HARD), snap)
    assert isinstance(d, Reject) and d.reason is Reason.NO_MATCHING_DEVICE
    soft = decide(job("j", memory_mib=8000), snapshot(node("a100", "A100", 1)))
    assert isinstance(soft, Reserve) and not soft.slices[0].whole and soft.slices[0].enforced
    mlu = decide(job("j", memory_mib=8000), snapshot(node("mlu", "MLU370", 1)))
    assert isinstance(mlu, Reserve) and not mlu.slices[0].enforced


def test_hard_isolation_whole_device_is_fine_anywhere():
    """A whole device is isolated by construction, so isolation=hard does not restrict it."""
    snap = snapshot(node("t4", "T4", 2))
    assert models_of(decide(job("j", isolation=Isolation.HARD), snap)) == {"T4"}


def test_share_semantics():
    """Compute-only shares take memory in proportion; memory-only shares take compute 0."""
    assert share_on(None, None, 25, 80000) == (20000, 25)
    assert share_on(4096, None, None, 80000) == (4096, 0)
    assert share_on(None, 50, 10, 80000) == (40000, 10)
    snap = snapshot(node("a", "A100", 1))
    d = decide(job("j", compute_pct=25), snap)
    assert isinstance(d, Reserve)
    assert (d.slices[0].memory_mib, d.slices[0].compute_pct, d.slices[0].whole) == (
        20480,
        25,
        False,
    )


def test_whole_device_needs_no_holders():
    """A whole-device request never lands on a device that already carries a share."""
    snap = snapshot(node("a", "A100", 1))
    pool = WorkingPool(snap, default_config())
    assert isinstance(decide(job("s", memory_mib=1000), pool, apply=True), Reserve)
    d = decide(job("w"), pool)
    assert isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY


def test_never_fits_unknown_model():
    """A model that no node has is rejected at once, blaming selector.models."""
    d = decide(job("j", models=["H100"]), mixed())
    assert (
        isinstance(d, Reject) and d.reason is Reason.UNKNOWN_MODEL and d.field == "selector.models"
    )


def test_never_fits_share_too_large():
    """A share larger than any matching device's memory is rejected, blaming device.memory_mib."""
    d = decide(job("j", memory_mib=100_000), mixed())
    assert isinstance(d, Reject) and d.reason is Reason.SHARE_TOO_LARGE
    assert d.field == "device.memory_mib"


def test_never_fits_same_node_gang_larger_than_any_node():
    """A same-node gang of more devices than any node has is rejected, not left waiting."""
    d = decide(job("j", count=9, gang=GangSpec(same_node=True)), mixed())
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_NODE_CAPACITY and d.field == "count"
    assert "has 8" in d.detail


def test_never_fits_domain_and_pool():
    """Same-domain gangs beyond the largest domain, and counts beyond the pool, are rejected."""
    snap = snapshot(node("a", "A100", 8, domain="nvl-1"), node("b", "A100", 8, domain="nvl-2"))
    d = decide(job("j", count=12, gang=GangSpec(same_node=False, same_domain=True)), snap)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_DOMAIN_CAPACITY
    d = decide(job("j", count=17), snap)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_POOL_CAPACITY


def test_never_fits_host_cpu():
    """Host CPU beyond every matching node is rejected, blaming host.cpu_milli."""
    d = decide(job("j", cpu_milli=1_000_000), mixed())
    assert isinstance(d, Reject) and d.field == "host.cpu_milli"


def test_never_fits_quota_limit():
    """A request above its queue's hard limit can never run and is rejected."""
    cfg = with_queues(default_config(), QueueConfig(name="t1", limit_units=2.0))
    d = decide(job("j", count=4, models=["A100"]), mixed(), cfg)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_QUOTA_LIMIT


def test_invalid_inputs_rejected():
    """Both memory fields, an unknown priority, or an unknown queue are rejected with the field."""
    snap = mixed()
    d = decide(job("j", memory_mib=10, memory_pct=10), snap)
    assert isinstance(d, Reject) and d.reason is Reason.INVALID_REQUEST
    d = decide(job("j", priority="urgent"), snap)
    assert isinstance(d, Reject) and d.reason is Reason.UNKNOWN_PRIORITY and d.field == "priority"
    d = decide(job("j", queue="nope"), snap)
    assert isinstance(d, Reject) and d.reason is Reason.UNKNOWN_QUEUE and d.field == "queue"


def test_never_fits_ignores_current_load_and_health():
    """never_fits judges the registered inventory: a busy or unhealthy device may serve later."""
    snap = snapshot(node("a", "A100", 2, health="unhealthy"))
    pool = WorkingPool(snap, default_config())
    assert never_fits(job("j", count=2), pool) is None
    d = decide(job("j", count=2), snap)
    assert isinstance(d, Wait) and d.reason is Reason.NO_MATCHING_DEVICE


def test_a_count_the_pool_holds_only_across_models_says_so():
    """Three NVIDIA devices from a pool of 2 A100 and 2 T4: a request takes one model, and the
    rejection says that and what the pool has, not just "the pool has 2 A100"."""
    snap = snapshot(node("a", "A100", 2), node("t", "T4", 2))
    d = decide(job("j", count=3, vendor=Vendor.NVIDIA), snap)
    assert isinstance(d, Reject) and d.reason is Reason.EXCEEDS_POOL_CAPACITY
    assert "of one model" in d.detail and "2 A100" in d.detail and "2 T4" in d.detail
    d = decide(job("j", count=5, vendor=Vendor.NVIDIA), snap)  # not even all of them together
    assert isinstance(d, Reject) and "of one model" not in d.detail
