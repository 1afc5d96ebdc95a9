"""The scheduler's incremental snapshot against a real redis-server: after any sequence of ledger
transitions, and across a flush, a restart, a rewind to an older save and a trimmed change log,
it equals a full read of the ledger."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace

import pytest
from redis.asyncio import Redis

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceSample, DeviceSpec, Health, JobRequested
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import (
    Admission,
    ChangeCursor,
    Holder,
    HostClaim,
    Ledger,
    LedgerChanges,
    NodeRecord,
    Reservation,
    ScriptResult,
    SliceClaim,
    UsageClaim,
)
from xpupool.ledger.ledger import SCRIPTS, script_source
from xpupool.placement.node_policies import NodeView
from xpupool.scheduler.domain import (
    PoolSnapshot,
    Reserve,
    SchedulerConfig,
    WorkingPool,
    decide_batch,
    default_config,
)
from xpupool.scheduler.snapshot import build_snapshot
from xpupool.scheduler.snapshot_cache import SnapshotCache

pytestmark = pytest.mark.integration

HEALTHS = (Health.HEALTHY, Health.HEALTHY, Health.DEGRADED, Health.UNHEALTHY)


def _spec(node: str, index: int, memory_mib: int) -> DeviceSpec:
    return device_spec(node, index, memory_mib, prefix="gpu")


async def _full(ledger: Ledger) -> PoolSnapshot:
    version = await ledger.version()
    return build_snapshot(await ledger.nodes(), await ledger.leases(), 0, version)


async def _check(cache: SnapshotCache, ledger: Ledger, step: str) -> None:
    """The cached snapshot equals a full read (the clock aside), record by record."""
    cached, _ = await cache.read(ledger)
    full = await _full(ledger)
    assert [n.node_id for n in cached.nodes] == [n.node_id for n in full.nodes], step
    for mine, truth in zip(cached.nodes, full.nodes, strict=True):
        assert mine == truth, f"{step}: node {truth.node_id}"
    assert [x.lease_id for x in cached.leases] == [x.lease_id for x in full.leases], step
    for mine_lease, true_lease in zip(cached.leases, full.leases, strict=True):
        assert mine_lease == true_lease, f"{step}: lease {true_lease.lease_id}"
    assert cached.version == full.version, step


async def _seq(ledger: Ledger) -> int:
    return int(await ledger.redis.get(ledger.key("changes-seq")) or 0)


class Workload:
    """Random ledger transitions over a small fleet, chosen from what the ledger holds."""

    def __init__(self, ledger: Ledger, seed: int) -> None:
        self.ledger = ledger
        self.rng = random.Random(seed)
        self.fleet: dict[str, list[DeviceSpec]] = {}
        self.jobs = 0

    async def _devices(self) -> list[str]:
        return [d.spec.device_id for n in await self.ledger.nodes() for d in n.devices]

    async def _leases(self, state: str | None = None) -> list[str]:
        return [x.lease_id for x in await self.ledger.leases() if state in (None, x.state)]

    async def register(self) -> str:
        rng = self.rng
        if self.fleet and rng.random() < 0.5:
            node = rng.choice(sorted(self.fleet))
            specs = list(self.fleet[node])
            change = rng.choice(("drop", "add", "resize", "same"))
            if change == "drop" and len(specs) > 1:
                specs.pop(rng.randrange(len(specs)))
            elif change == "add":
                specs.append(_spec(node, max(s.index for s in specs) + 1, 40_960))
            elif change == "resize":
                i = rng.randrange(len(specs))
                specs[i] = _spec(node, specs[i].index, rng.choice((40_960, 81_920)))
        else:
            node = f"n{len(self.fleet)}"
            change = "new"
            specs = [_spec(node, i, 81_920) for i in range(rng.randint(1, 4))]
        self.fleet[node] = specs
        result = await self.ledger.register_node(node, specs, 64_000, 512_000, {"rack": node})
        assert result.ok
        return f"register {node} ({change})"

    async def reserve(self) -> str:
        rng, devices = self.rng, await self._devices()
        self.jobs += 1
        job = f"j{self.jobs}"
        chosen = rng.sample(devices, min(len(devices), rng.choice((0, 1, 1, 2))))
        whole = rng.random() < 0.4
        slices = [
            SliceClaim(d, whole=True) if whole else SliceClaim(d, rng.choice((1024, 8192)), 25)
            for d in chosen
        ]
        host = (
            {rng.choice(sorted(self.fleet)): HostClaim(1000, 4096)}
            if not slices or rng.random() < 0.5
            else {}
        )
        result = await self.ledger.reserve(
            Reservation(
                job_id=job,
                lease_id=f"lease-{job}",
                tenant="t",
                queue="q",
                priority=rng.randint(0, 1000),
                owner="o",
                ttl_ms=rng.choice((20, 60_000)),
                hold_ms=rng.choice((20, 60_000)),
                slices=slices,
                host=host,
                usage=[UsageClaim("q", "units", 1.0)],
            )
        )
        return f"reserve {job} {chosen} host={sorted(host)}: {result.ok} {result.reason}"

    async def grant(self) -> str:
        leases = await self._leases("reserved")
        if not leases:
            return "grant: none"
        lease = self.rng.choice(leases)
        return f"grant {lease}: {(await self.ledger.grant(lease)).ok}"

    async def renew(self) -> str:
        leases = [x for x in await self.ledger.leases() if x.state == "active"]
        if not leases:
            return "renew: none"
        lease = self.rng.choice(leases)
        holder = Holder(lease.tenant, lease.secret, lease.token)
        result = await self.ledger.renew(lease.lease_id, holder)
        return f"renew {lease.lease_id}: {result.ok}"

    async def end(self) -> str:
        leases = await self._leases()
        if not leases:
            return "end: none"
        lease = self.rng.choice(leases)
        return f"end {lease}: {(await self.ledger.end(lease, 'released')).outcome}"

    async def expire(self) -> str:
        await asyncio.sleep(0.03)
        return f"expire: {(await self.ledger.expire_due()).ended}"

    async def health(self) -> str:
        devices = await self._devices()
        if not devices:
            return "health: none"
        device, health = self.rng.choice(devices), self.rng.choice(HEALTHS)
        await self.ledger.set_health(device, health, "test")
        return f"health {device} {health.value}"

    async def reap(self) -> str:
        await asyncio.sleep(0.01)
        nodes = sorted(self.fleet)
        silent = self.rng.choice(nodes) if nodes else None
        for node in nodes:
            if node != silent:
                await self.ledger.heartbeat(node)
        return f"reap (silent {silent}): {(await self.ledger.reap_nodes(5)).lost}"

    async def load(self) -> str:
        """One node's collector tick: load for some of its devices, with its heartbeat (a
        node that must register again has it refused)."""
        nodes = await self.ledger.nodes()
        if not nodes:
            return "load: none"
        node = self.rng.choice(nodes)
        devices = [d.spec.device_id for d in node.devices]
        picked = self.rng.sample(devices, min(len(devices), 3))
        samples = [
            DeviceSample(
                device_id=d,
                util_pct=self.rng.choice((None, 0.0, 50.0, 95.5)),
                memory_used_mib=self.rng.choice((None, 100)),
            )
            for d in picked
        ]
        tick = await self.ledger.heartbeat(node.node_id, samples)
        return f"load {[(s.device_id, s.util_pct) for s in samples]} ({tick.reason or 'ok'})"

    async def preempt(self) -> str:
        leases = await self._leases()
        if not leases:
            return "preempt: none"
        lease = self.rng.choice(leases)
        return f"preempt {lease}: {(await self.ledger.request_preemption(lease, 'x')).ok}"

    async def step(self) -> str:
        if not self.fleet:
            return await self.register()
        op = self.rng.choices(
            (
                self.register,
                self.reserve,
                self.grant,
                self.renew,
                self.end,
                self.expire,
                self.health,
                self.reap,
                self.load,
                self.preempt,
            ),
            weights=(2, 6, 4, 2, 3, 1, 2, 1, 2, 1),
        )[0]
        return await op()


@pytest.mark.parametrize(
    ("seed", "max_records"),
    # The records read with the log (the usual case), read apart when there are more than the
    # script may return (0: always), and a mix of both.
    [(1, 256), (2, 256), (3, 256), (4, 0), (5, 3)],
)
async def test_incremental_snapshot_equals_a_full_read_after_random_transitions(
    ledger: Ledger, seed: int, max_records: int
) -> None:
    """After every few random transitions the cache's snapshot equals a full read, and all but
    the first read are incremental (re-reading only what changed)."""
    work = Workload(ledger, seed)
    cache = SnapshotCache(full_every=1_000, max_records=max_records)
    history: list[str] = []
    incremental = 0
    for _ in range(150):
        for _ in range(work.rng.choice((1, 1, 2, 3))):
            history.append(await work.step())
        await _check(cache, ledger, " / ".join(history[-3:]))
        assert cache.last is not None
        incremental += not cache.last.full
    assert incremental == 149


async def test_concurrent_transitions_during_reads_are_caught_up(ledger: Ledger) -> None:
    """Transitions racing the cache's reads are picked up by the read after them."""
    work, cache = Workload(ledger, 7), SnapshotCache()
    for _ in range(5):
        await work.register()

    async def churn() -> None:
        for _ in range(100):
            await work.step()

    task = asyncio.create_task(churn())
    while not task.done():
        await cache.read(ledger)
    await task
    await _check(cache, ledger, "after the churn")


async def test_flush_and_rebuild_past_the_cursor_forces_a_full_read(ledger: Ledger) -> None:
    """A flushed Redis rebuilt with more changes than the cache had seen is read in full, not
    trusted from a change sequence that started over."""
    work, cache = Workload(ledger, 11), SnapshotCache()
    for _ in range(30):
        await work.step()
    await _check(cache, ledger, "before the flush")
    seen = await _seq(ledger)
    await ledger.redis.flushall()
    work = Workload(ledger, 12)
    while await _seq(ledger) <= seen + 5:
        await work.step()
    await _check(cache, ledger, "after the flush")
    assert cache.last is not None and cache.last.full


async def _answering(redis: Redis) -> None:
    for _ in range(100):
        try:
            await redis.ping()
            return
        except Exception:  # noqa: BLE001  (the client reconnects on its next command)
            await asyncio.sleep(0.1)


async def test_restart_from_an_older_save_forces_a_full_read(
    redis_server: RedisServer, ledger: Ledger
) -> None:
    """redis-server restarted from files older than the cache's last read (a lost disk, a
    failover to a lagging replica): the change sequence starts from an older value and passes
    the cursor again with other changes, yet the next read is a full one, and exact."""
    work, cache = Workload(ledger, 21), SnapshotCache()
    for _ in range(20):
        await work.step()
    await _check(cache, ledger, "before the save")
    redis_server.stop()
    saved = redis_server.workdir.parent / "saved-aof"
    shutil.copytree(redis_server.workdir / "appendonlydir", saved)
    redis_server.start()
    await _answering(ledger.redis)
    for _ in range(2):
        for _ in range(15):
            await work.step()
        await _check(cache, ledger, "after the save")
    assert cache.last is not None and not cache.last.full
    seen = await _seq(ledger)
    redis_server.kill()
    shutil.rmtree(redis_server.workdir / "appendonlydir")
    shutil.copytree(saved, redis_server.workdir / "appendonlydir")
    redis_server.start()
    await _answering(ledger.redis)
    assert await _seq(ledger) < seen
    while await _seq(ledger) <= seen + 5:  # other transitions from the save on, past the cursor
        await work.step()
    await _check(cache, ledger, "after the rewind")
    assert cache.last is not None and cache.last.full


async def test_restart_reads_everything_once_then_carries_on(
    redis_server: RedisServer, ledger: Ledger
) -> None:
    """redis-server killed and restarted from its AOF: the first read after it is a full one
    (the cache cannot know what the restart kept), the next ones incremental again."""
    work, cache = Workload(ledger, 31), SnapshotCache()
    for _ in range(30):
        await work.step()
    await _check(cache, ledger, "before the restart")
    redis_server.restart()
    await _answering(ledger.redis)
    for full in (True, False, False):
        for _ in range(10):
            await work.step()
        await _check(cache, ledger, "after the restart")
        assert cache.last is not None and cache.last.full == full


async def test_trimmed_change_log_forces_a_full_read(ledger: Ledger) -> None:
    """A change log trimmed past the cache's cursor makes the next read a full one; a cursor
    newer than the trim stays incremental."""
    constants = "CHANGE_LOG_MAX, CHANGE_LOG_TRIM = 50000, 5000"
    assert all(constants in script_source(name) for name in SCRIPTS)
    ledger._scripts = {  # noqa: SLF001  (the same scripts with a tiny log)
        name: ledger.redis.register_script(
            script_source(name).replace(constants, "CHANGE_LOG_MAX, CHANGE_LOG_TRIM = 12, 4")
        )
        for name in ledger._scripts  # noqa: SLF001
    }
    work, cache = Workload(ledger, 41), SnapshotCache()
    for _ in range(5):
        await work.register()
    await _check(cache, ledger, "start")
    for _ in range(40):
        await work.step()
    assert await ledger.redis.zcard(ledger.key("changes")) < 40
    await _check(cache, ledger, "after the trim")
    assert cache.last is not None and cache.last.full
    await work.health()
    await _check(cache, ledger, "after one more change")
    assert cache.last is not None and not cache.last.full


async def test_every_nth_read_is_full(ledger: Ledger) -> None:
    """The safety net: a full read every ``full_every`` reads, whatever the log says."""
    work, cache = Workload(ledger, 51), SnapshotCache(full_every=3, full_interval_s=0.0)
    kinds = []
    for _ in range(8):
        await work.step()
        await _check(cache, ledger, "step")
        assert cache.last is not None
        kinds.append(cache.last.full)
    assert kinds == [True, False, False, False, True, False, False, False]


async def test_full_reads_are_no_more_frequent_than_their_interval(ledger: Ledger) -> None:
    """Reads at the pace of arriving batches do not make the safety net read a large pool in
    full every ``full_every`` reads: only once ``full_interval_s`` has passed too."""
    work, cache = Workload(ledger, 52), SnapshotCache(full_every=3, full_interval_s=3600.0)
    kinds = []
    for _ in range(8):
        await work.step()
        await _check(cache, ledger, "step")
        assert cache.last is not None
        kinds.append(cache.last.full)
    assert kinds == [True] + [False] * 7


async def test_a_device_id_listed_under_two_nodes_stays_exact(ledger: Ledger) -> None:
    """A device id registered again under another node (a misconfigured collector) is listed
    under both, as a full read shows it; each change to it reaches both cached nodes."""
    cache = SnapshotCache()
    await ledger.register_node("a", [_spec("a", 0, 81_920)], 64_000, 512_000)
    await _check(cache, ledger, "a registered")
    moved = _spec("a", 0, 40_960)
    await ledger.register_node("b", [moved, _spec("b", 1, 81_920)], 64_000, 512_000)
    await _check(cache, ledger, "a/gpu0 registered under b too")
    await ledger.set_health("a/gpu0", Health.UNHEALTHY)
    await _check(cache, ledger, "a/gpu0 unhealthy")
    await ledger.register_node("b", [_spec("b", 1, 81_920)], 64_000, 512_000)
    await _check(cache, ledger, "a/gpu0 dropped by b")
    assert cache.last is not None and not cache.last.full


def _pool_state(pool: WorkingPool) -> dict[str, object]:
    """Everything a decision reads from a working pool, in comparable form."""
    return {
        "nodes": [n.node_id for n in pool.nodes],
        "devices": pool.devices,
        "counters": (
            pool.dev_mem_free,
            pool.dev_compute_free,
            pool.dev_holders,
            pool.dev_exclusive,
            pool.dev_ok,
            pool.node_cpu_free,
            pool.node_mem_free,
            pool.node_busy,
            pool.node_up,
        ),
        "whole_free": [{k: v for k, v in wf.items() if v} for wf in pool.class_whole_free],
        "leases": {
            lid: (pl.state, pl.queue, pl.devices, pl.nodes) for lid, pl in pool.leases.items()
        },
        "node_leases": pool.node_leases,
        "queue_leases": {q: ids for q, ids in pool.queue_leases.items() if ids},
        "priorities": {q: c for q, c in pool.queue_priorities.items() if c},
        "terminating": pool.terminating,
        "usage": {
            q: (round(u.units, 6), round(u.devices, 6), round(u.memory_mib, 3))
            for q, u in pool.usage.items()
            if u.units > 1e-9 or u.devices > 1e-9 or u.memory_mib > 1e-6
        },
        "totals": (pool.total_devices, pool.total_memory_mib, pool.total_units),
        "arrays": {
            name: list(getattr(pool.arrays(), name))
            for name in ("mem_free", "compute_free", "holders", "exclusive", "node_busy")
        },
    }


def _synced(view: NodeView, pool: WorkingPool) -> NodeView:
    view.sync(pool)
    return view


def _view_state(view: NodeView) -> dict[str, list[object]]:
    st = view.state
    return {
        name: getattr(st, name).tolist()
        for name in ("gpu_free", "cpu_free", "mem_free", "class_counts", "pod_count")
    }


@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_the_kept_working_pool_equals_a_new_one_after_random_transitions(
    ledger: Ledger, seed: int
) -> None:
    """The working pool ``read_pool`` keeps between reads, refreshed from the changes and with
    each batch's own decisions taken back out, equals a pool built from the same snapshot."""
    work, cache = Workload(ledger, seed), SnapshotCache(full_every=1_000)
    config = default_config()
    rng = random.Random(seed)
    refreshed = 0
    view: NodeView | None = None  # the node view a policy keeps, synced from the kept pool
    for k in range(120):
        step = await work.step()
        snapshot, _, pool = await cache.read_pool(ledger, config)
        builds = cache.pool_builds
        fresh = WorkingPool(snapshot, config)
        assert _pool_state(pool) == _pool_state(fresh), f"{k}: {step}"
        if view is None or not view.matches(pool):
            view = NodeView(pool, {})
        view.sync(pool)
        assert _view_state(view) == _view_state(_synced(NodeView(fresh, {}), fresh)), f"{k}"
        # A batch decided on the kept pool, then taken back out: the pool is the ledger's again.
        requests = [
            JobRequested(job_id=f"probe-{k}-{i}", tenant="t", count=rng.choice((0, 1, 2)))
            for i in range(rng.randint(0, 3))
        ]
        with cache.deciding(pool) as settle:
            decisions = settle(decide_batch(requests, pool, config))
        if any(isinstance(d, Reserve) for _, d in decisions):
            refreshed += 1
        assert _pool_state(pool) == _pool_state(WorkingPool(snapshot, config)), f"{k}: settled"
        again, _, same = await cache.read_pool(ledger, config)
        assert same is pool and cache.pool_builds == builds  # nothing changed: no new pool
        assert _pool_state(same) == _pool_state(WorkingPool(again, config))
    # Most reads refreshed the kept pool rather than building one (health changes, node
    # registrations and reaps build anew), and decisions were taken back out along the way.
    assert cache.pool_builds < 60 and refreshed > 10, (cache.pool_builds, refreshed)


async def test_only_a_full_read_calls_its_hook(ledger: Ledger) -> None:
    """The scheduler freezes its heap after a full read (the copy it built lives until the next
    one), not after every incremental read."""
    calls: list[bool] = []
    cache = SnapshotCache(after_full_read=lambda: calls.append(True))
    work = Workload(ledger, 61)
    await work.register()
    await cache.read(ledger)
    assert calls == [True]
    await work.step()
    await cache.read(ledger)
    assert calls == [True]
    cache.invalidate()
    await cache.read(ledger)
    assert calls == [True, True]


async def _until(condition: Callable[[], bool]) -> bool:
    """Whether ``condition`` holds within 2 s."""
    for _ in range(200):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


async def _follow(cache: SnapshotCache, ledger: Ledger, stop: asyncio.Event) -> asyncio.Task[None]:
    """The change feed into ``cache``, once it is live."""
    task = asyncio.create_task(ledger.follow_changes(cache.note_change, stop, retry_s=0.05))
    assert await _until(lambda: cache.follows_feed), "the change feed never came up"
    return task


async def _read_is_kept_and_current(
    cache: SnapshotCache, ledger: Ledger, config: SchedulerConfig
) -> bool:
    """After a read, the kept pool is offered and shows the ledger's current view."""
    await cache.read_pool(ledger, config)
    kept = await cache.kept_pool(config)
    return kept is not None and kept[3].seq == await _seq(ledger)


async def _announced(cache: SnapshotCache, config: SchedulerConfig) -> bool:
    """Whether the feed has told ``cache`` that its copy is no longer current (within 2 s)."""
    for _ in range(200):
        if await cache.kept_pool(config) is None:
            return True
        await asyncio.sleep(0.01)
    return False


@pytest.mark.parametrize("seed", [41, 42])
async def test_the_change_feed_announces_every_change_and_the_kept_pool_is_exact(
    ledger: Ledger, seed: int
) -> None:
    """Every transition that moves the change sequence is announced on the feed, so the kept
    pool is never offered after one, unless it changed live load alone (a utilisation): that is
    announced as such, wants a warm read, and leaves the kept pool offered. While nothing moved
    it (a heartbeat, a load sample that changes no utilisation) the kept pool is offered, and
    after a read it equals a pool of a fresh read."""
    work, cache, config = Workload(ledger, seed), SnapshotCache(full_every=1_000), default_config()
    stop = asyncio.Event()
    follower = await _follow(cache, ledger, stop)
    try:
        await work.register()
        offered = load_only = 0
        for k in range(80):
            # An announcement still on its way when a read starts withdraws that read's pool
            # too (the read may not have seen its change): read again until one is offered.
            kept = None
            for _ in range(20):
                await cache.read_pool(ledger, config)
                kept = await cache.kept_pool(config)
                if kept is not None:
                    break
                await asyncio.sleep(0.01)
            assert kept is not None, f"{k}: nothing is announced, yet no kept pool is offered"
            snapshot, _, pool, cursor = kept
            assert cursor.seq == await _seq(ledger), k
            full = await _full(ledger)
            assert _pool_state(pool) == _pool_state(WorkingPool(full, config)), k
            assert snapshot.nodes == full.nodes and snapshot.leases == full.leases, k
            offered += 1
            before = await _seq(ledger)
            step = await work.step()
            if await _seq(ledger) == before:
                continue
            if step.startswith("load"):
                assert await _until(cache.wants_read), f"{k}: {step} was not announced"
                assert await cache.kept_pool(config) is not None, f"{k}: {step} withdrew it"
                load_only += 1
            else:
                assert await _announced(cache, config), f"{k}: {step} was not announced"
        assert offered == 80
        assert load_only > 0  # the workload changed utilisation at least once
    finally:
        stop.set()
        await follower


async def test_a_lost_change_feed_offers_no_kept_pool_until_it_is_back(
    redis_server: RedisServer, ledger: Ledger
) -> None:
    """redis-server restarted: changes made while the feed was down went unannounced, so no
    kept pool is offered until the feed is back and a read has brought the copy up to date."""
    work, cache, config = Workload(ledger, 51), SnapshotCache(), default_config()
    stop = asyncio.Event()
    for _ in range(5):
        await work.register()
    follower = await _follow(cache, ledger, stop)
    try:
        await cache.read_pool(ledger, config)
        assert await cache.kept_pool(config) is not None
        redis_server.restart()
        await _answering(ledger.redis)
        assert await _announced(cache, config)
        assert await _until(lambda: cache.follows_feed)  # subscribed again
        assert await _read_is_kept_and_current(cache, ledger, config)
    finally:
        stop.set()
        await follower
    assert await cache.kept_pool(config) is None  # stopped following: nothing is known


async def test_an_own_change_alone_wants_no_read_of_its_own(ledger: Ledger) -> None:
    """A grant this replica made (its admission answered the change sequence) is announced
    like any change, so the kept pool is no longer offered; but it alone does not call for a
    warm read, whether its announcement comes before its answer or after. The next change by
    anyone else does, and the read that follows brings both in."""
    work, cache, config = Workload(ledger, 71), SnapshotCache(), default_config()
    await work.register()
    stop = asyncio.Event()
    follower = await _follow(cache, ledger, stop)
    try:
        for job in ("own-1", "own-2"):
            await cache.read_pool(ledger, config)
            assert not cache.wants_read()
            device = (await ledger.nodes())[0].devices[0].spec.device_id
            placement = reservation(job, SliceClaim(device, 1024, 10), secret="s" * 48)
            if job == "own-1":  # told before its announcement can come
                cache.own_change(await _seq(ledger) + 1)
            [granted] = await ledger.admit_many(
                [Admission(job, 500, b"{}", None, "queued", tenant="t", placement=placement)]
            )
            assert granted.outcome == "granted" and granted.change_seq == await _seq(ledger)
            assert await _announced(cache, config)  # its announcement has come
            cache.own_change(granted.change_seq)  # (again, for own-1: no harm)
            assert not cache.wants_read(), job
        await work.reserve()
        assert await _until(cache.wants_read)
        assert await _read_is_kept_and_current(cache, ledger, config)
    finally:
        stop.set()
        await follower


async def test_an_own_admission_is_not_announced_while_its_replica_alone_follows_the_feed(
    ledger: Ledger,
) -> None:
    """An admission whose caller follows the feed (``caller_follows_feed``) is not announced
    while that caller is the feed's only subscriber; its answer, counted as the replica's own
    change, withdraws the kept pool until a read brings it in. With a second follower (another
    replica) the same admission is announced to both, as is one that does not ask."""
    work, config = Workload(ledger, 73), default_config()
    await work.register()
    device = await _roomy_device(ledger)
    cache, other = SnapshotCache(), SnapshotCache()
    stop = asyncio.Event()
    followers = [await _follow(cache, ledger, stop)]
    try:
        await cache.read_pool(ledger, config)
        cache.changed.clear()
        [granted] = await ledger.admit_many(
            [replace(_placed_admission("quiet-1", device), caller_follows_feed=True)]
        )
        assert granted.outcome == "granted" and granted.change_seq == await _seq(ledger)
        # Anything announced is in the subscriber's socket by now: a later command's answer
        # (a round trip on another connection) comes after the script's PUBLISH was written.
        await ledger.redis.ping()
        await asyncio.sleep(0.1)
        assert not cache.changed.is_set(), "announced to the only follower, which asked not"
        cache.own_change(granted.change_seq)
        assert await cache.kept_pool(config) is None, "its own unread grant left it offered"
        assert not cache.wants_read()  # its own change alone calls for no read
        assert await _read_is_kept_and_current(cache, ledger, config)

        # A second follower: the same kind of admission is announced to both.
        followers.append(await _follow(other, ledger, stop))
        await other.read_pool(ledger, config)
        for job, asks in (("quiet-2", True), ("loud-3", False)):
            cache.changed.clear()
            other.changed.clear()
            [granted] = await ledger.admit_many(
                [replace(_placed_admission(job, device), caller_follows_feed=asks)]
            )
            assert granted.outcome == "granted", job
            assert await _until(cache.changed.is_set), f"{job}: not announced to its caller"
            assert await _until(other.changed.is_set), f"{job}: not announced to the other"
            assert await cache.kept_pool(config) is None, job
    finally:
        stop.set()
        for follower in followers:
            await follower


def _commit_of(
    ledger: Ledger, admissions: list[Admission]
) -> Callable[..., Awaitable[tuple[list[ScriptResult], LedgerChanges | None]]]:
    async def commit(
        cursor: ChangeCursor | None, max_records: int, known: Mapping[str, NodeRecord]
    ) -> tuple[list[ScriptResult], LedgerChanges | None]:
        return await ledger.admit_and_read(admissions, cursor, max_records, known)

    return commit


async def _roomy_device(ledger: Ledger) -> str:
    """A device of a node of its own, registered now: a share fits on it."""
    node = f"roomy-{len(await ledger.nodes())}"
    assert (await ledger.register_node(node, [_spec(node, 0, 81920)], 64_000, 256_000)).ok
    return f"{node}/gpu0"


def _placed_admission(job: str, device: str) -> Admission:
    placement = reservation(job, SliceClaim(device, 1024, 10), secret="s" * 48)
    return Admission(job, 500, b"{}", None, "queued", tenant="t", placement=placement)


@pytest.mark.parametrize("seed", [81, 82])
async def test_a_read_carried_by_a_commit_serves_the_next_batch_once(
    ledger: Ledger, seed: int
) -> None:
    """``read_along``: the commit's round trip brings the change log as it was right after it
    (the commit's own grant and whatever else changed since the last read); ``after`` sees the
    commit's answer before the read is applied; the next batch gets the pool, once, as a read of
    its own would give it, and its snapshot equals a full read."""
    work, cache, config = Workload(ledger, seed), SnapshotCache(full_every=1_000), default_config()
    await work.register()
    await cache.read_pool(ledger, config)
    for _ in range(5):
        await work.step()  # someone else's changes, unread
    device = await _roomy_device(ledger)
    last_read = cache.last
    seen: list[tuple[str, bool]] = []

    async def after(results: list[ScriptResult]) -> None:
        seen.append((results[0].outcome, cache.last is last_read))

    [mine] = await cache.read_along(
        ledger, config, _commit_of(ledger, [_placed_admission("mine", device)]), after
    )
    assert mine.outcome == "granted", mine
    assert seen == [("granted", True)]  # after ran before the read was applied
    recent = await cache.recent_pool(config)
    assert recent is not None
    snapshot, _, pool = recent
    full = await _full(ledger)
    assert snapshot.nodes == full.nodes and snapshot.leases == full.leases
    assert "lease-mine" in {lease.lease_id for lease in snapshot.leases}
    assert _pool_state(pool) == _pool_state(WorkingPool(full, config))
    assert await cache.recent_pool(config) is None  # once


async def test_a_carried_read_is_not_offered_when_old_or_after_another_read(
    ledger: Ledger,
) -> None:
    work, cache, config = Workload(ledger, 84), SnapshotCache(), default_config()
    await work.register()
    await cache.read_pool(ledger, config)
    device = await _roomy_device(ledger)

    async def nothing(results: list[ScriptResult]) -> None:
        return None

    for job in ("old", "overtaken"):
        await cache.read_along(
            ledger, config, _commit_of(ledger, [_placed_admission(job, device)]), nothing
        )
        if job == "old":
            assert await cache.recent_pool(config, max_age_s=0.0) is None
        else:
            await cache.read_pool(ledger, config)  # a read of its own since
            assert await cache.recent_pool(config) is None


async def test_a_commit_whose_read_failed_leaves_the_copy_unread(ledger: Ledger) -> None:
    """The commit stands, nothing is applied and nothing is offered: what was announced is still
    unread, so a warm read is still wanted. A commit that fails gives the read up the same way,
    and the cache is free for the next reader."""
    work, cache, config = Workload(ledger, 85), SnapshotCache(), default_config()
    await work.register()
    await cache.read_pool(ledger, config)
    cache.note_change(True, 10_000)  # announced by someone else, not read yet
    assert cache.wants_read()
    reads = cache.last

    async def without_read(
        cursor: ChangeCursor | None, max_records: int, known: Mapping[str, NodeRecord]
    ) -> tuple[str, LedgerChanges | None]:
        return "committed", None

    async def nothing(result: str) -> None:
        return None

    assert await cache.read_along(ledger, config, without_read, nothing) == "committed"
    assert cache.last is reads and cache.wants_read()
    assert await cache.recent_pool(config) is None

    async def failing(
        cursor: ChangeCursor | None, max_records: int, known: Mapping[str, NodeRecord]
    ) -> tuple[str, LedgerChanges | None]:
        raise ConnectionError("redis away")

    with pytest.raises(ConnectionError):
        await cache.read_along(ledger, config, failing, nothing)
    assert cache.wants_read()
    await asyncio.wait_for(cache.read_pool(ledger, config), 5)  # the lock was given back
    assert not cache.wants_read()


async def test_an_announcement_of_a_change_the_read_saw_leaves_the_kept_pool_offered(
    ledger: Ledger,
) -> None:
    """The feed announces a change after its script ran, so a read can see a change before its
    announcement arrives (a commit's own grant read right after it does, always): such a late
    announcement withdraws nothing and wants no read. A change past the read's cursor does both,
    and so does the feed coming or going (changes may have gone unannounced)."""
    work, cache, config = Workload(ledger, 86), SnapshotCache(), default_config()
    await work.register()
    cache.note_change(True)  # the feed is up
    await cache.read_pool(ledger, config)
    seen = await _seq(ledger)
    cache.note_change(True, seen)  # late: the read has it
    assert await cache.kept_pool(config) is not None and not cache.wants_read()
    cache.note_change(True, seen + 1)
    assert await cache.kept_pool(config) is None and cache.wants_read()
    await cache.read_pool(ledger, config)
    assert await cache.kept_pool(config) is not None
    cache.note_change(True, 0)  # the feed came up again
    assert await cache.kept_pool(config) is None and cache.wants_read()
