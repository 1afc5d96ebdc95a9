"""A kept node view synced after each change equals one built fresh from the pool, whether the
rows that changed are brought in one by one (a few) or through numpy at once (many); and only
rows whose values changed (free counters, or the pods they hold) get a new version: the
policies' caches re-score exactly those."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from domain_builders import lease, node, snapshot

from xpupool.placement import node_policies
from xpupool.placement.inventory import HostCharge
from xpupool.placement.node_policies import NodeView
from xpupool.placement.pool import WorkingPool
from xpupool.scheduler.domain import default_config


def _pool() -> WorkingPool:
    """Every kind of device the view prices: known and unknown memory, an unhealthy one, a
    mixed node (two rows), and leases held whole and shared."""
    plain = node("a", "A100", 4)
    unknown = node("u", "A100", 2, memory_total_mib=0, memory_free_mib=0)
    sick = node("s", "T4", 2)
    sick = replace(sick, devices=(replace(sick.devices[0], health="unhealthy"), sick.devices[1]))
    mixed = node("m", "T4", 2)
    a100 = tuple(
        replace(d, device_id=f"m/{d.index + 2}", index=d.index + 2)
        for d in node("m", "A100", 2).devices
    )
    mixed = replace(mixed, devices=(*mixed.devices, *a100))
    held = (
        lease("whole", ["a/0"]),
        lease("share", ["a/1"], share=(20_000, 30)),
        lease("host", ["m/3"], share=(1_000, 10), host=(HostCharge("m", 4_000, 8_000),)),
    )
    return WorkingPool(snapshot(plain, unknown, sick, mixed, leases=held), default_config())


def _state(view: NodeView) -> dict[str, list[object]]:
    st = view.state
    return {
        name: getattr(st, name).tolist()
        for name in ("gpu_free", "cpu_free", "mem_free", "class_counts", "pod_count")
    }


@pytest.mark.parametrize("few_rows", [0, 4, 100])
def test_a_kept_view_equals_a_fresh_one_after_every_change(
    few_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_policies, "FEW_ROWS", few_rows)
    rng = random.Random(few_rows)
    pool = _pool()
    view = NodeView(pool, {})
    view.sync(pool)
    devices = [d.device_id for d in pool.devices]
    live: list[str] = []
    for k in range(300):
        before = view.state.node_version.copy()
        values = _state(view)
        if live and rng.random() < 0.45:
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            lease_id = f"l{k}"
            chosen = rng.sample(devices, rng.choice((1, 1, 2)))
            taken = lease(
                lease_id,
                chosen,
                share=None if rng.random() < 0.3 else (rng.choice((500, 4_000)), 5),
                host=(HostCharge(chosen[0].split("/")[0], 1_000, 2_000),) if k % 3 == 0 else (),
            )
            try:
                pool.add_lease(taken)
            except ValueError:
                continue  # a device held whole, or not enough left of it: nothing changed
            live.append(lease_id)
        view.sync(pool)
        fresh = NodeView(pool, {})
        fresh.sync(pool)
        assert _state(view) == _state(fresh), k
        now = _state(view)
        for row in range(view.state.num_nodes):
            moved = any(now[name][row] != values[name][row] for name in now)
            assert (view.state.node_version[row] != before[row]) == moved, (k, row)
