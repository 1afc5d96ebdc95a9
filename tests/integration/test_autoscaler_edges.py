"""Autoscaler cycles on a real ledger (Redis) with a scripted provider: faults and edge cases of
the control loop that the whole-stack tests cannot stage deterministically (a node that never
registers, a provider that reports a node failed)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from redis.typing import EncodableT, FieldT

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.autoscaler.drain import LedgerDrainer
from xpupool.autoscaler.loop import Autoscaler, AutoscalerDeps
from xpupool.autoscaler.metrics import AutoscalerMetrics
from xpupool.autoscaler.pools import PoolConfig, PoolSource, ProviderConfig
from xpupool.autoscaler.providers import (
    NodeLifecycle,
    ProvidedNode,
    Provider,
    ProviderError,
    ProviderResult,
)
from xpupool.autoscaler.settings import AutoscalerSettings
from xpupool.autoscaler.solver import PlacementSolver, device_specs
from xpupool.autoscaler.state import AutoscalerState
from xpupool.contracts import (
    JobReason,
    JobRequested,
    NodeReady,
    NodeRemoved,
    ScaleAction,
    ScaleDecision,
    ScaleFailed,
)
from xpupool.devices.catalog import load_catalog
from xpupool.ledger import Ledger, SliceClaim

pytestmark = pytest.mark.timeout(60)

POOLS = """
pools:
  - name: spot
    node: {{model: A100-SXM4-80GB, count: 2, cpu_milli: 64000, memory_mib: 524288}}
    cost_per_hour: 4.0
    min_size: {min_size}
    max_size: {max_size}
    provisioning_delay_s: 0
    scale_down: {{cooldown_s: {cooldown_s}, low_watermark: 1.0}}
    provider: {{type: simulated}}
"""


class ScriptedProvider:
    """A provider whose nodes exist only in memory; the test decides which ones register and
    which ones fail. Idempotent by request id, as the real ones are."""

    kind = "scripted"

    def __init__(self) -> None:
        self.nodes: dict[str, ProvidedNode] = {}
        self.requests: dict[str, list[str]] = {}
        self.removed: list[str] = []
        self.serial = 0
        #: like a Cluster API Machine being deleted: a removed node is still listed, as
        #: ``removing``, until the test forgets it
        self.keep_removing = False

    async def add(self, pool: PoolConfig, count: int, request_id: str) -> ProviderResult:
        planned = self.requests.get(request_id)
        if planned is None:
            # As the simulated and Kubernetes providers do: every node held counts, failed ones
            # included.
            if len(self.nodes) + count > pool.max_size:
                raise ProviderError(
                    f"pool {pool.name}: {len(self.nodes)} nodes + {count} exceed max_size"
                )
            planned = []
            for _ in range(count):
                self.serial += 1
                planned.append(f"{pool.name}-{self.serial}")
            self.requests[request_id] = planned
            for node_id in planned:
                self.nodes[node_id] = ProvidedNode(node_id, NodeLifecycle.PROVISIONING, request_id)
        return ProviderResult(
            request_id=request_id,
            pool=pool.name,
            nodes=tuple(self.nodes[n] for n in planned if n in self.nodes),
        )

    async def remove(
        self, pool: PoolConfig, node_ids: Sequence[str], request_id: str
    ) -> ProviderResult:
        for node_id in node_ids:
            held = self.nodes.pop(node_id, None)
            if held is None or held.state is NodeLifecycle.REMOVING:
                continue
            self.removed.append(node_id)
            if self.keep_removing:
                self.nodes[node_id] = ProvidedNode(node_id, NodeLifecycle.REMOVING, held.request_id)
        return ProviderResult(request_id=request_id, pool=pool.name)

    async def list(self, pool: PoolConfig) -> tuple[ProvidedNode, ...]:
        return tuple(self.nodes.values())

    def fail(self, node_id: str) -> None:
        held = self.nodes[node_id]
        self.nodes[node_id] = ProvidedNode(node_id, NodeLifecycle.FAILED, held.request_id)


class Harness:
    """One autoscaler replica on the test's ledger, its events collected."""

    def __init__(self, ledger: Ledger, pools_file: Path, **settings: Any) -> None:
        self.ledger = ledger
        self.provider = ScriptedProvider()
        self.events: list[msgspec.Struct] = []
        self.state = AutoscalerState(ledger.redis, ledger.prefix, "a")

        def make_provider(_: ProviderConfig) -> Provider:
            return self.provider

        self.deps = AutoscalerDeps(
            ledger=ledger,
            state=self.state,
            pools=PoolSource(pools_file),
            solver=PlacementSolver(),
            settings=AutoscalerSettings(**settings),
            drainer=LedgerDrainer(ledger),
            metrics=AutoscalerMetrics(),
            make_provider=make_provider,
        )
        self.autoscaler = Autoscaler(self.deps, publish=self._publish)

    async def _publish(self, event: msgspec.Struct) -> None:
        self.events.append(event)

    async def cycle(self) -> Any:
        term = await self.autoscaler.renew_lease()
        assert term is not None
        return await self.autoscaler.cycle(term)

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def ups(self) -> list[ScaleDecision]:
        return [d for d in self.of(ScaleDecision) if d.action is ScaleAction.SCALE_UP]


def pools_file(
    tmp_path: Path, *, min_size: int = 0, max_size: int = 3, cooldown_s: float = 600
) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS.format(min_size=min_size, max_size=max_size, cooldown_s=cooldown_s))
    return path


async def register(ledger: Ledger, pool: PoolConfig, node_id: str) -> None:
    """What the node's collector does on its first start."""
    devices = device_specs(pool, node_id, load_catalog())
    result = await ledger.register_node(node_id, devices, pool.node.cpu_milli, pool.node.memory_mib)
    assert result.ok, result


async def wait_pending(ledger: Ledger, job_id: str, count: int = 1) -> None:
    """A request the scheduler keeps pending because no node can hold it yet."""
    request = JobRequested(job_id=job_id, tenant="team-a", count=count)
    result = await ledger.pend(
        job_id,
        500,
        msgspec.json.encode(request),
        None,
        JobReason.INSUFFICIENT_CAPACITY.value,
        tenant="team-a",
    )
    assert result.ok, result


async def test_a_node_that_never_registers_is_given_back_and_replaced(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A scale-up whose node never registers fails after its deadline (ScaleFailed). From then
    on that node is not incoming capacity any more: the pending demand gets a new node instead
    of waiting on the dead one forever, and the dead one is given back to its provider instead
    of being held (and paid for) for ever."""
    run = Harness(
        ledger,
        pools_file(tmp_path),
        autoscaler_provisioning_grace_s=0.3,
        autoscaler_settle_s=0,
    )
    await wait_pending(ledger, "job-1", count=2)
    await run.cycle()
    assert [(d.pool, d.count) for d in run.ups()] == [("spot", 1)]
    assert list(run.provider.nodes) == ["spot-1"]

    await asyncio.sleep(0.5)  # past 3 x 0 s + 0.3 s: spot-1 never registered
    await run.cycle()
    failed = run.of(ScaleFailed)
    assert failed and "given up" in failed[-1].error, run.events

    for _ in range(3):
        await run.cycle()
    # The demand is answered by a new node, not by the one that never came.
    assert len(run.ups()) == 2, run.events
    assert "spot-2" in run.provider.nodes
    # The node that never registered is given back, and said so.
    assert "spot-1" in run.provider.removed, run.events
    assert "spot-1" in {e.node_id for e in run.of(NodeRemoved)}
    status = await run.cycle()
    spot = status.pools[0]
    assert "spot-1" not in {n.node_id for n in spot.nodes}

    # Its collector starts after all, while the provider is still taking it away: it comes up
    # draining, and no grant lands on a node on its way out.
    late = device_specs(spot_pool(run), "spot-1", load_catalog())
    assert (await ledger.register_node("spot-1", late, 64_000, 256_000)).ok
    assert await ledger.redis.hget(ledger.key("node", "spot-1"), "draining") == b"1"
    refused = await ledger.reserve(reservation("late", SliceClaim(late[0].device_id, whole=True)))
    assert not refused.ok and refused.reason == "node_draining", refused


def spot_pool(run: Harness) -> PoolConfig:
    pool = run.deps.pools.current().get("spot")
    assert pool is not None
    return pool


async def test_an_operators_drain_of_an_unknown_node_is_refused_not_remembered(
    ledger: Ledger,
) -> None:
    """Only the autoscaler holds a drain for a node the ledger has not seen: an operator's
    drain of a mistyped node id is refused, and a node of that id registers in service."""
    refused = await ledger.set_node_draining("n-typo", True)
    assert not refused.ok and refused.reason == "unknown_node"
    await register_one(ledger, "n-typo")
    assert await ledger.redis.hget(ledger.key("node", "n-typo"), "draining") is None
    held = await ledger.set_node_draining("n-later", True, hold_unregistered=True)
    assert held.ok and held.previous == "in_service", held
    lifted = await ledger.set_node_draining("n-later", False, hold_unregistered=True)
    assert lifted.ok and lifted.previous == "draining", lifted
    await register_one(ledger, "n-later")
    assert await ledger.redis.hget(ledger.key("node", "n-later"), "draining") is None


async def register_one(ledger: Ledger, node_id: str) -> None:
    assert (await ledger.register_node(node_id, [device_spec(node_id, 0)], 64_000, 256_000)).ok


async def test_a_node_failed_at_its_provider_is_given_back_before_its_replacement(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A pool at max_size 1 (min_size 1) whose node dies: the ledger declares it lost, its
    provider reports it failed. It is given back, then replaced: the provider, which counts the
    failed node toward max_size, is never asked for a second one beside it (no ScaleFailed
    loop), and the pool does not keep paying for a node that serves nothing."""
    path = pools_file(tmp_path, min_size=1, max_size=1)
    run = Harness(ledger, path, autoscaler_settle_s=0)
    pool = run.deps.pools.current().pools[0]
    await run.cycle()  # min_size: spot-1
    await register(ledger, pool, "spot-1")
    await run.cycle()
    status = await run.cycle()
    assert status.pools[0].ready == 1

    run.provider.fail("spot-1")
    await asyncio.sleep(0.05)
    await ledger.reap_nodes(1)  # silent: lost in the ledger too
    for _ in range(3):
        await run.cycle()
    assert not run.of(ScaleFailed), run.of(ScaleFailed)
    assert run.provider.removed == ["spot-1"], run.events
    assert list(run.provider.nodes) == ["spot-2"]
    removes = [d for d in run.of(ScaleDecision) if d.action is ScaleAction.REMOVE]
    assert [d.node_ids for d in removes] == [["spot-1"]]


async def test_a_node_its_provider_is_still_removing_is_not_taken_back_as_a_new_node(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A drained node is removed; its provider takes a while to delete it (a Cluster API
    Machine stays listed, ``Deleting``, and its collector still heartbeats meanwhile). The
    autoscaler must not adopt it again as a fresh pool node: no second NodeReady for it, not
    counted as a ready node of the pool, not drained and removed over and over."""
    run = Harness(ledger, pools_file(tmp_path, min_size=0, cooldown_s=0), autoscaler_settle_s=0)
    run.provider.keep_removing = True
    pool = run.deps.pools.current().pools[0]
    await wait_pending(ledger, "job-1", count=2)
    await run.cycle()
    await register(ledger, pool, "spot-1")
    await ledger.drop_pending("job-1", "cancelled", None, "served elsewhere")
    for _ in range(3):  # ready, idle (cool-down 0): drained, then removed
        await run.cycle()
    assert run.provider.removed == ["spot-1"], run.events
    assert [e.node_id for e in run.of(NodeReady)] == ["spot-1"]

    for _ in range(3):  # still listed as removing, still registered in the ledger
        status = await run.cycle()
    assert [e.node_id for e in run.of(NodeReady)] == ["spot-1"], run.events
    spot = status.pools[0]
    assert (spot.ready, spot.provisioning) == (0, 0), spot
    assert run.provider.removed == ["spot-1"]
    removes = [d for d in run.of(ScaleDecision) if d.action is ScaleAction.REMOVE]
    assert len(removes) == 1, removes


PREDICTIVE_POOLS = """
pools:
  - name: spot
    node: {model: A100-SXM4-80GB, count: 2, cpu_milli: 64000, memory_mib: 524288}
    cost_per_hour: 4.0
    min_size: 0
    max_size: 4
    provisioning_delay_s: 0
    scale_down: {cooldown_s: 0, low_watermark: 1.0}
    predictive: {enabled: true}
    provider: {type: simulated}
"""


async def test_a_predictive_pool_does_not_drain_what_its_forecast_adds_again(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A predictive pool whose demand has stood at four devices (two nodes) all day adds two
    nodes ahead of it. Idle past the cool-down, they were drained, which took them out of the
    pool's size, so the next cycle's forecast added two more, and so on: in the trace replay
    2,546 additions against 46 reactive ones, at 1.6 times the reactive run's cost. Kept while
    the forecast wants them, they are added once and never drained."""
    path = tmp_path / "pools.yaml"
    path.write_text(PREDICTIVE_POOLS)
    run = Harness(ledger, path, autoscaler_settle_s=0)
    pool = run.deps.pools.current().pools[0]
    now, bucket = time.time(), run.deps.settings.autoscaler_bucket_s
    day: dict[FieldT, EncodableT] = {
        f"{math.floor(now / bucket - i) * bucket:.0f}": 4 for i in range(24 * 3600 // 300)
    }
    await ledger.redis.hset(run.state.key("demand:spot"), mapping=day)
    await run.cycle()
    assert [(d.pool, d.count) for d in run.ups()] == [("spot", 2)], run.events
    for node_id in list(run.provider.nodes):
        await register(ledger, pool, node_id)
    for _ in range(4):
        await run.cycle()
    decisions = run.of(ScaleDecision)
    assert [d.action for d in decisions] == [ScaleAction.SCALE_UP], decisions
    assert run.provider.removed == [] and len(run.provider.nodes) == 2
