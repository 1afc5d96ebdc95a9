"""Edge cases of the placement library found in review, each pinned by the test that found it.

* ``FragmentationPolicy`` weighs shapes by how few nodes of the empty cluster host them; a policy
  kept across a rebuilt node view (a node added or removed, the same models) must weigh them for
  the new cluster, i.e. decide as a fresh policy does on the same state.
* The node view turns a share into milli-GPU against the smallest device it may go to; a device
  class the share cannot fit on must not make it look like a whole GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpupool.contracts.payloads import DeviceDemand, DeviceSelector, Intent, JobRequested
from xpupool.placement.default import DefaultPolicy
from xpupool.placement.demand import make_demand
from xpupool.placement.engine import Placement
from xpupool.placement.frag import ShapeDistribution
from xpupool.placement.inventory import (
    DeviceState,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)
from xpupool.placement.ours import FragmentationPolicy, set_demand, target_distribution
from xpupool.placement.policies import FGDPolicy, Policy
from xpupool.placement.pool import WorkingPool
from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand

# ---------------------------------------------------------------------- kept policy, new cluster


def test_scarcity_weights_follow_a_rebuilt_cluster() -> None:
    """Decided once on a cluster, then on a larger one of the same model (a node view rebuilt
    after nodes were added): the decision is a fresh policy's, whose scarcity weights count
    the larger cluster's hosts."""
    big, mid, one = (64_000, 8), (32_000, 2), (32_000, 1)
    first = [big, mid, one, big]
    added = [mid, one, big, mid, one]
    before = [NodeSpec(f"a{i}", c, 10**6, g, "A") for i, (c, g) in enumerate(first)]
    after = before + [NodeSpec(f"b{i}", c, 10**6, g, "A") for i, (c, g) in enumerate(added)]
    pods = [
        PodDemand(8000, 0, 2, 1000),
        PodDemand(120_000, 0, 1, 1000),
        PodDemand(120_000, 0, 1, 1000),
        PodDemand(8000, 0, 1, 1000),
        PodDemand(60_000, 0, 1, 1000),
        PodDemand(2000, 0, 2, 1000),
        PodDemand(4000, 0, 1, 250),
    ]
    target = target_distribution(pods)
    kept = FragmentationPolicy(target)
    small = ClusterState.from_nodes(before)
    kept.choose(small, pods[0])
    state = ClusterState.from_nodes(after)
    for pod in (pods[0], pods[0]):
        placed = FragmentationPolicy(target).choose(state, pod)
        assert placed is not None
        state.allocate(placed)
    for pod in pods:
        assert kept.choose(state, pod) == FragmentationPolicy(target).choose(state, pod), pod


MODELS = ("A", "B")
KINDS = ((96_000, 8), (128_000, 8), (32_000, 2), (16_000, 1), (104_000, 4), (8_000, 4))


@st.composite
def _pod(draw: st.DrawFn) -> PodDemand:
    kind = draw(st.sampled_from(["cpu", "share", "one", "multi"]))
    cpu = draw(st.sampled_from([0, 2000, 4000, 8000, 16_000, 32_000, 60_000, 120_000]))
    models = draw(st.one_of(st.none(), st.sampled_from([frozenset({"A"}), frozenset({"B"})])))
    if kind == "cpu":
        return PodDemand(cpu, 1024)
    if kind == "share":
        return PodDemand(cpu, 1024, 1, draw(st.sampled_from([100, 250, 500, 700])), models)
    return PodDemand(cpu, 1024, 1 if kind == "one" else draw(st.sampled_from([2, 4, 8])), 1000)


def _on(state: ClusterState, name: str, choice: NodeChoice) -> NodeChoice:
    """``choice`` on the node called ``name`` of ``state`` (indices move when nodes do)."""
    node = state.names.index(name)
    return NodeChoice(node, choice.gpus, choice.gpu_milli, choice.cpu_milli, choice.memory_mib)


@dataclass
class _Cluster:
    """Node specs and the placements live on them, rebuilt as a node view is."""

    specs: list[NodeSpec]
    live: list[tuple[str, NodeChoice]]

    def state(self) -> ClusterState:
        state = ClusterState.from_nodes(self.specs)
        for name, choice in self.live:
            state.allocate(_on(state, name, choice))
        return state


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("decide"), _pod()),
        st.tuples(st.just("release"), st.integers(0, 10**6)),
        st.tuples(st.just("add"), st.tuples(st.sampled_from(KINDS), st.sampled_from(MODELS))),
        st.tuples(st.just("remove"), st.integers(0, 10**6)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    start=st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from(MODELS)), min_size=1, max_size=6
    ),
    workload=st.lists(_pod(), min_size=1, max_size=12),
    ops=_OPS,
)
def test_kept_policies_decide_as_fresh_ones_across_decisions_releases_and_node_changes(
    start: list[tuple[tuple[int, int], str]],
    workload: list[PodDemand],
    ops: list[tuple[str, object]],
) -> None:
    """FGD and xpupool kept across decisions, releases and node views rebuilt for nodes added
    or removed (their caches: kept costs per shape, ``F`` per node, node groups, the scarcity
    weights) choose what a fresh policy chooses on the same state, every decision."""
    target = target_distribution(workload)
    demand = set_demand(workload)
    typical = ShapeDistribution.typical(workload)

    def fresh() -> tuple[Policy, Policy]:
        return FragmentationPolicy(target, demand=demand), FGDPolicy(typical)

    cluster = _Cluster([], [])
    serial = 0
    for (cpu, gpus), model in start:
        cluster.specs.append(NodeSpec(f"n{serial:03d}", cpu, 10**6, gpus, model))
        serial += 1
    kept = fresh()
    state = cluster.state()
    for op, arg in ops:
        if op == "decide":
            assert isinstance(arg, PodDemand)
            for pol, ref in zip(kept, fresh(), strict=True):
                got = pol.choose(state, arg)
                assert got == ref.choose(state, arg), (pol.name, arg)
            choice = kept[0].choose(state, arg)  # the same state decided on again: kept costs
            if choice is not None:
                state.allocate(choice)
                cluster.live.append((state.names[choice.node], choice))
        elif op == "release" and cluster.live:
            assert isinstance(arg, int)
            name, choice = cluster.live.pop(arg % len(cluster.live))
            state.release(_on(state, name, choice))
        elif op == "add":
            assert isinstance(arg, tuple)
            (cpu, gpus), model = arg
            cluster.specs.append(NodeSpec(f"n{serial:03d}", cpu, 10**6, gpus, model))
            serial += 1
            state = cluster.state()
        elif op == "remove" and len(cluster.specs) > 1:
            assert isinstance(arg, int)
            gone = cluster.specs.pop(arg % len(cluster.specs)).name
            cluster.live = [(n, c) for n, c in cluster.live if n != gone]
            state = cluster.state()


# ---------------------------------------------------------------------- shares on mixed pools


@dataclass(frozen=True)
class _Accounts:
    def charge_queue(self, tenant: str, queue: str, /) -> str:
        return queue

    def path(self, queue: str, /) -> Sequence[str]:
        return (queue,)


def _device(node: str, index: int, model: str, memory: int) -> DeviceState:
    return DeviceState(
        f"{node}/{index}",
        node,
        "nvidia",
        model,
        memory,
        memory,
        index=index,
        uuid=f"u-{node}-{index}",
    )


def _node(node: str, *devices: DeviceState) -> NodeState:
    return NodeState(node, devices, 64_000, 64_000, 10**6, 10**6)


def _shared_a100_pool(*others: NodeState) -> WorkingPool:
    """Two A100s on one node, the first holding a 20 GiB share; ``others`` listed first."""
    shared = LeaseSlice("a/0", 20_000, 10, False)
    a0 = replace(
        _device("a", 0, "A100", 81_920),
        memory_free_mib=81_920 - 20_000,
        compute_free_pct=90,
        holders=1,
    )
    nodes = (*others, _node("a", a0, _device("a", 1, "A100", 81_920)))
    lease = LeaseState("l", "j0", "t", "q", 0, 0.0, (shared,))
    return WorkingPool(PoolSnapshot(nodes, (lease,)), _Accounts())


def _place_share(pool: WorkingPool, intent: Intent) -> Placement | None:
    policy = DefaultPolicy.create()
    request = JobRequested(
        job_id="j", device=DeviceDemand(memory_mib=24_000), intent=intent, selector=DeviceSelector()
    )
    demand = make_demand(request, pool)
    return policy.place_pool(pool, demand, policy.rank_classes(pool, demand, demand.classes))


def test_a_share_is_not_measured_against_devices_it_cannot_fit_on() -> None:
    """A 24 GB share in a pool that also has 16 GB cards (or a device of unknown memory) goes
    where it goes without them: onto the A100 already shared, keeping the idle one whole. It
    used to be measured against the smallest matching card, where it is more than a whole
    GPU, so the node view saw it as a whole-GPU pod and sent it to the idle A100."""
    for intent in (Intent.CHEAPEST, Intent.ANY):
        alone_pool = _shared_a100_pool()
        alone = _place_share(alone_pool, intent)
        assert alone is not None
        assert [alone_pool.devices[i].device_id for i in alone.devices] == ["a/0"], intent
        for other in (
            _node("t", _device("t", 0, "T4", 15_360)),
            _node("u", _device("u", 0, "X1", 0)),
        ):
            pool = _shared_a100_pool(other)
            placed = _place_share(pool, intent)
            assert placed is not None, (intent, other.node_id)
            assert [pool.devices[i].device_id for i in placed.devices] == ["a/0"], intent
