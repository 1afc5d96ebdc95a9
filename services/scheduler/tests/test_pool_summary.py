"""The pool gauges' summary kept per node: equal to a full walk of the snapshot whatever changed,
and walking only the nodes whose state is a new object."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest

from xpupool.placement.inventory import DeviceState, NodeState, PoolSnapshot
from xpupool.scheduler import metrics
from xpupool.scheduler.metrics import PoolSummary, pool_rows

MODELS = (
    ("nvidia", "A100", 81920, 2.0),
    ("nvidia", "T4", 15360, 0.5),
    ("ascend", "910B", 65536, 1.6),
)


def fleet(nodes: int, rng: random.Random) -> PoolSnapshot:
    states = []
    for n in range(nodes):
        devices = []
        for i in range(rng.choice([1, 2, 4, 8])):
            vendor, model, memory, units = rng.choice(MODELS)  # mixed nodes too
            devices.append(
                DeviceState(
                    device_id=f"n{n}/d{i}",
                    node_id=f"n{n}",
                    vendor=vendor,
                    model=model,
                    memory_total_mib=memory,
                    memory_free_mib=memory,
                    capacity_units=units,
                )
            )
        states.append(NodeState(f"n{n}", tuple(devices)))
    return PoolSnapshot(nodes=tuple(states))


def churn(snapshot: PoolSnapshot, rng: random.Random) -> PoolSnapshot:
    """Some nodes' devices taken, shared, given back or reporting load; a node gone, one new."""
    nodes = list(snapshot.nodes)
    for k in rng.sample(range(len(nodes)), len(nodes) // 5):
        node = nodes[k]
        devices = list(node.devices)
        j = rng.randrange(len(devices))
        d = devices[j]
        devices[j] = rng.choice(
            [
                replace(d, exclusive=True, holders=1, memory_free_mib=0),
                replace(d, holders=d.holders + 1, memory_free_mib=d.memory_free_mib // 2),
                replace(d, exclusive=False, holders=0, memory_free_mib=d.memory_total_mib),
                replace(d, util_pct=rng.uniform(0, 100)),
            ]
        )
        nodes[k] = replace(node, devices=tuple(devices))
    del nodes[rng.randrange(len(nodes))]
    nodes.append(NodeState(f"new-{rng.randrange(10**9)}", nodes[0].devices))
    return PoolSnapshot(nodes=tuple(nodes))


async def test_kept_summary_equals_a_full_walk_through_changes() -> None:
    rng = random.Random(7)
    snapshot = fleet(300, rng)
    summary = PoolSummary()
    for _ in range(20):
        assert await summary.rows(snapshot) == pool_rows(snapshot)
        snapshot = churn(snapshot, rng)


async def test_only_nodes_whose_state_is_new_are_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    snapshot = fleet(50, rng)
    walked: list[str] = []
    node_sums = metrics.node_sums

    def counting(node: NodeState) -> metrics._NodeSums:
        walked.append(node.node_id)
        return node_sums(node)

    monkeypatch.setattr(metrics, "node_sums", counting)
    summary = PoolSummary()
    await summary.rows(snapshot)
    assert len(walked) == 50
    walked.clear()
    await summary.rows(snapshot)
    assert walked == []
    changed = replace(snapshot.nodes[4], devices=snapshot.nodes[4].devices[:1])
    await summary.rows(replace(snapshot, nodes=(*snapshot.nodes[:4], changed, *snapshot.nodes[5:])))
    assert walked == [changed.node_id]


async def test_a_long_walk_lets_the_event_loop_run() -> None:
    """A fleet whose every node changed is summed in slices, with other work in between."""
    snapshot = fleet(PoolSummary.YIELD_EVERY_NODES * 4, random.Random(5))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await PoolSummary().rows(snapshot)
    task.cancel()
    assert ticks - before >= 3
