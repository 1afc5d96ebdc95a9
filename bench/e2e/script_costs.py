"""What the ledger's admission and end scripts cost inside Redis, and what their parts cost.

``python bench/e2e/script_costs.py [--nodes 200] [--jobs 2000]``: a redis-server of its own
(AOF, ``appendfsync always``, as the ledger runs), ``--nodes`` nodes of eight devices, then
``--jobs`` admissions that grant on arrival (``pend.lua``) each followed by its release
(``end.lua``), one at a time, nothing else running, shaped as the stack sends them (``Jobs``:
the host charge and the quota counters of a queue and its parent; a holder's release whose event
the lease-manager publishes). Redis's SLOWLOG (threshold 0) gives each
script's median time inside Redis, without the round trip or the fsync. Then the same server
times the parts such scripts are made of, as bare scripts: ``redis.call``s, key names built the
scripts' way, and ``cjson`` encodes and decodes of a table the size of a lease's slices. The AOF
bytes one admission and its release write are reported too, and what the ledger keeps of each
ended job: its records' memory, and the time an AOF rewrite of them all takes.

Last, a collector's tick (``ticks``): a node of eight devices heartbeating with its samples in one
script, as the collector does, for a busy node (utilisation that moves every tick, with memory
that moves too or that the job's framework holds) and for idle nodes read as the vendors' tools
report them (``../shared/fixtures/vendor-cli``: an idle NVIDIA H20 or Cambricon MLU370 at 0 % and
0 MiB; an idle Ascend 910B at 0 % AI Core and 4,174-4,175 MB of HBM in use by chip, held):
Redis's time and the AOF bytes a tick.

``--baseline-lua DIR`` compares two versions of the scripts on one server: this machine's speed
moves by a third within minutes, more than most changes to a script, so runs one after another
cannot tell them apart. Each job then runs on this version's ledger and on one whose scripts come
from ``DIR``, in turn, and each script's median is given as a ratio to the baseline's; so does
each collector's tick, whose total time in Redis and AOF bytes are given beside the baseline's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from xpupool.contracts import DeviceSample, DeviceSpec, Vendor
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import (
    Admission,
    Holder,
    HostClaim,
    Ledger,
    Reservation,
    SliceClaim,
    SliceMeta,
    UsageClaim,
    new_lease_secret,
)
from xpupool.ledger.ledger import SCRIPTS, script_source

# Bare scripts of the parts the ledger's scripts are made of (KEYS[1]: a hash of 30 fields).
PARTS = {
    "45 redis.call HGET": "for i=1,45 do redis.call('HGET', KEYS[1], 'f1') end return 1",
    "45 redis.call HSET": "for i=1,45 do redis.call('HSET', KEYS[1], 'f1', i) end return 1",
    "45 key names": (
        "local P = KEYS[1] local function k(kind, id) if id == nil then return P .. kind end "
        "return P .. kind .. ':' .. id end "
        "for i=1,45 do local x = k('dev', 'node-0001/nvidia3') end return 1"
    ),
    "HGETALL of 30 fields": "return redis.call('HGETALL', KEYS[1])",
    "4 cjson encode+decode, 1 KB": (
        "local t = {} for i=1,20 do t[i] = {device_id='n/nvidia'..i, memory_mib=1000, "
        "compute_pct=25, whole=false} end "
        "for i=1,4 do cjson.decode(cjson.encode(t)) end return 1"
    ),
}


def _spec(node: str, index: int, production: bool = False) -> DeviceSpec:
    return DeviceSpec(
        device_id=f"{node}/nvidia{index}",
        vendor=Vendor.NVIDIA,
        model="A100-SXM4-80GB" if production else "A100",
        index=index,
        uuid=f"GPU-{uuid.uuid4()}" if production else f"GPU-{node}-{index}",
        memory_mib=81920,
    )


@dataclass(frozen=True)
class Ids:
    """The names one job's records carry: short ones (``j7``, ``t``), or as production makes
    them (``production``): a client's UUID job id, ``lease-<32 hex>`` (the scheduler's
    ``_new_lease_id``), a 15-character tenant and queue, node names of 29 characters, and each
    slice's device metadata (vendor, model, index, UUID) as the scheduler sends it."""

    production: bool

    def node(self, i: int) -> str:
        return f"gpu-a100-pool-7f9c2-node-{i:04d}" if self.production else f"n{i:05d}"

    def job(self, j: int) -> tuple[str, str]:
        if self.production:
            return str(uuid.uuid4()), f"lease-{uuid.uuid4().hex}"
        return f"j{j}", f"lease-j{j}"

    @property
    def tenant(self) -> str:
        return "research-vision" if self.production else "t"


async def _slowlog(redis: Redis) -> list[dict[str, Any]]:
    return list(await redis.slowlog_get(1_000_000))


class Jobs:
    """One ledger's nodes and the admissions and releases of its jobs, as the stack makes them:
    each placement carries the host charge and the quota counters the scheduler's
    ``reservation_of`` adds (units and the device's model, for the job's queue and its parent),
    and each release is a holder's, whose ``LeaseEnded`` the lease-manager publishes itself
    (``direct``)."""

    def __init__(self, ledger: Ledger, nodes: int, ids: Ids) -> None:
        self.ledger = ledger
        self.nodes = nodes
        self.ids = ids
        self.specs: dict[str, DeviceSpec] = {}
        self.kept: list[tuple[str, str]] = []

    async def register(self) -> None:
        for i in range(self.nodes):
            node = self.ids.node(i)
            devices = [_spec(node, d, self.ids.production) for d in range(8)]
            self.specs.update((d.device_id, d) for d in devices)
            await self.ledger.register_node(node, devices, 256_000, 2_000_000)

    async def one(self, j: int) -> None:
        """Admit job ``j`` placed on arrival (``pend.lua``), then release it (``end.lua``)."""
        ids = self.ids
        node = ids.node(j % self.nodes)
        spec = self.specs[f"{node}/nvidia{(j // self.nodes) % 8}"]
        meta = (
            SliceMeta(vendor=spec.vendor.value, model=spec.model, index=spec.index, uuid=spec.uuid)
            if ids.production
            else None
        )
        claim = SliceClaim(spec.device_id, memory_mib=1000, compute_pct=25, meta=meta)
        job_id, lease_id = ids.job(j)
        self.kept.append((job_id, lease_id))
        queue = ids.tenant if ids.production else "q"
        placement = Reservation(
            job_id=job_id,
            lease_id=lease_id,
            tenant=ids.tenant,
            queue=queue,
            priority=500,
            owner=ids.tenant if ids.production else "o",
            ttl_ms=60_000,
            hold_ms=60_000,
            slices=[claim],
            host={node: HostClaim(cpu_milli=4000, memory_mib=16_384)},
            usage=[
                UsageClaim(scope, field, 0.25)
                for scope in (queue, "root")
                for field in ("units", f"devices:{spec.model}")
            ],
            secret=new_lease_secret(),
        )
        admission = Admission(
            job_id, 500, b"{}", None, "queued", tenant=ids.tenant, placement=placement
        )
        [admitted] = await self.ledger.admit_many([admission])
        lease = self.ledger.granted_lease(admitted)
        if lease is None:
            raise RuntimeError(f"job {job_id} was not granted: {admitted}")
        holder = Holder(ids.tenant, lease.secret, lease.token)
        released = await self.ledger.release(lease.lease_id, holder, direct=True)
        if not released.ok:
            raise RuntimeError(f"lease {lease.lease_id} was not released: {released}")


async def ledger_scripts(
    redis: Redis, nodes: int, jobs: int, ids: Ids, baseline_lua: Path | None = None
) -> None:
    ledger = Ledger(redis, "bench")
    measured = Jobs(ledger, nodes, ids)
    await measured.register()
    names = {ledger._scripts[name].sha: name for name in SCRIPTS}  # noqa: SLF001
    baseline = None
    if baseline_lua is not None:
        # The same jobs on a ledger of its own whose scripts are the baseline's, one job each in
        # turn on the same server: both see the machine as it is at that moment.
        base_ledger = Ledger(redis, "baseline")
        base_ledger._scripts = {  # noqa: SLF001
            name: redis.register_script(script_source(name, baseline_lua)) for name in SCRIPTS
        }
        names.update(
            {s.sha: f"baseline {name}" for name, s in base_ledger._scripts.items()}  # noqa: SLF001
        )
        baseline = Jobs(base_ledger, nodes, ids)
        await baseline.register()
    await redis.slowlog_reset()
    aof0 = (await redis.info("persistence"))["aof_current_size"]
    for j in range(jobs):
        await measured.one(j)
        if baseline is not None:
            await baseline.one(j)
    aof1 = (await redis.info("persistence"))["aof_current_size"]
    durations: dict[str, list[int]] = {}
    for entry in await _slowlog(redis):
        command = entry["command"].split()
        if command[0].upper() == b"EVALSHA":
            name = names.get(command[1].decode(), command[1].decode())
            durations.setdefault(name, []).append(entry["duration"])
    for name in ("pend", "end"):
        got = statistics.median(durations.get(name, [0]))
        line = f"{name + '.lua':<30} {got:7.1f} us median over {len(durations.get(name, []))} calls"
        if baseline is not None:
            base = statistics.median(durations.get(f"baseline {name}", [0]))
            line += f"; the baseline's {base:.1f} us, {got / base:.3f} of it (interleaved)"
        print(line)
    if baseline is None:
        print(f"{'AOF per admission + release':<30} {(aof1 - aof0) / jobs:7.0f} bytes")
        await retained(redis, ledger, measured.kept)


async def retained(redis: Redis, ledger: Ledger, kept: list[tuple[str, str]]) -> None:
    """What the ledger keeps of each ended job (``MEMORY USAGE`` of its lease's and its job's
    records, medians over a sample, and of the usage records over all), and how long rewriting
    the AOF of all that takes."""
    jobs = len(kept)
    sample = kept[:: max(1, jobs // 200)]
    for kind, position in (("lease", 1), ("job", 0)):
        sizes = [await redis.memory_usage(ledger.key(kind, ids[position])) or 0 for ids in sample]
        print(f"{'memory per ended ' + kind:<30} {statistics.median(sizes):7.0f} bytes")
    usage = [
        await redis.memory_usage(ledger.key(name), samples=0) or 0
        for name in ("usage-rec", "usage-ended")
    ]
    print(f"{'memory per usage record':<30} {sum(usage) / jobs:7.0f} bytes (with its index)")
    started = time.perf_counter()
    await redis.bgrewriteaof()
    while True:
        info = await redis.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            break
        await asyncio.sleep(0.002)
    took = time.perf_counter() - started
    print(f"{'AOF rewrite of the ledger':<30} {1000 * took:7.1f} ms, {jobs} ended jobs")


def _tick_samples(node: str, shape: str, tick: int) -> list[DeviceSample]:
    """One tick's samples of ``node``'s eight devices, as ``shape`` reads on real tools."""
    devices = [f"{node}/nvidia{d}" for d in range(8)]
    if shape == "busy, memory held":  # a job whose framework holds its memory pool
        return [
            DeviceSample(device_id=d, util_pct=float(40 + (tick * 7 + i * 13) % 61),
                         memory_used_mib=20_000 + i * 977)
            for i, d in enumerate(devices)
        ]  # fmt: skip
    if shape == "busy":  # load that moves each tick: a job's utilisation and memory
        return [
            DeviceSample(device_id=d, util_pct=float(40 + (tick * 7 + i * 13) % 61),
                         memory_used_mib=20_000 + (tick * 131 + i * 977) % 40_000)
            for i, d in enumerate(devices)
        ]  # fmt: skip
    if shape == "idle, 0 MiB":  # nvidia-smi on an idle H20, cnmon on an idle MLU370
        return [DeviceSample(device_id=d, util_pct=0.0, memory_used_mib=0) for d in devices]
    # npu-smi on an idle 910B: 0 % AI Core, 4174-4175 MB of HBM in use by chip; the recorded
    # output is one reading, so each chip's is held from tick to tick
    return [
        DeviceSample(device_id=d, util_pct=0.0, memory_used_mib=4174 + i % 2)
        for i, d in enumerate(devices)
    ]


async def ticks(
    redis: Redis, nodes: int = 50, rounds: int = 6, baseline_lua: Path | None = None
) -> None:
    """Redis's time (SLOWLOG) and the AOF bytes of a collector's tick (its heartbeat with its
    samples, one script), by the shape of its samples; with ``baseline_lua``, each tick also
    runs on a ledger whose scripts are the baseline's, in turn on the same server."""
    ledgers = {"this": Ledger(redis, "ticks-this")}  # names of one length: equal AOF
    if baseline_lua is not None:
        base = Ledger(redis, "ticks-base")
        base._scripts = {  # noqa: SLF001
            name: redis.register_script(script_source(name, baseline_lua)) for name in SCRIPTS
        }
        ledgers["baseline"] = base
    shas = {ledger._scripts["heartbeat"].sha: v for v, ledger in ledgers.items()}  # noqa: SLF001
    names = [f"tick-node-{i:04d}" for i in range(nodes)]
    for ledger in ledgers.values():
        for name in names:
            devices = [_spec(name, d) for d in range(8)]
            assert (await ledger.register_node(name, devices, 256_000, 2_000_000)).ok
    for shape in ("busy", "busy, memory held", "idle, 0 MiB", "idle, Ascend HBM"):
        for ledger in ledgers.values():
            for name in names:  # each node's first tick of this shape
                await ledger.heartbeat(name, _tick_samples(name, shape, 0))
        await redis.slowlog_reset()
        aof = dict.fromkeys(ledgers, 0)
        for tick in range(1, rounds + 1):
            for name in names:
                samples = _tick_samples(name, shape, tick)
                for version, ledger in ledgers.items():
                    before = (await redis.info("persistence"))["aof_current_size"]
                    await ledger.heartbeat(name, samples)
                    aof[version] += (await redis.info("persistence"))["aof_current_size"] - before
        spent = dict.fromkeys(ledgers, 0)
        for e in await _slowlog(redis):
            command = e["command"].split()
            if command[0].upper() == b"EVALSHA" and command[1].decode() in shas:
                spent[shas[command[1].decode()]] += e["duration"]
        count = nodes * rounds
        line = (
            f"{'tick, ' + shape:<30} {spent['this'] / count:7.1f} us in Redis, "
            f"{aof['this'] / count:6.0f} bytes of AOF"
        )
        if baseline_lua is not None:
            line += (
                f"; the baseline's {spent['baseline'] / count:.1f} us "
                f"({spent['this'] / spent['baseline']:.3f} of it, interleaved), "
                f"{aof['baseline'] / count:.0f} bytes"
            )
        print(line)


async def parts(redis: Redis) -> None:
    await redis.hset("bench:h", mapping={f"f{i}": str(i) for i in range(30)})
    for name, source in PARTS.items():
        script = redis.register_script(source)
        await script(keys=["bench:h"])
        await redis.slowlog_reset()
        for _ in range(300):
            await script(keys=["bench:h"])
        got = [
            e["duration"]
            for e in await _slowlog(redis)
            if e["command"].upper().startswith(b"EVALSHA")
        ]
        print(f"{name:<30} {statistics.median(got):7.1f} us median")


async def main(nodes: int, jobs: int, ids: Ids, baseline_lua: Path | None = None) -> None:
    server = RedisServer(Path(tempfile.mkdtemp(prefix="xpupool-script-costs-")) / "redis")
    server.start()
    try:
        redis = Redis.from_url(server.url)
        await redis.config_set("slowlog-log-slower-than", 0)
        await redis.config_set("slowlog-max-len", 1_000_000)
        try:
            await ledger_scripts(redis, nodes, jobs, ids, baseline_lua)
            if baseline_lua is None:
                await parts(redis)
            await ticks(redis, baseline_lua=baseline_lua)
        finally:
            await redis.aclose()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument(
        "--production-ids",
        action="store_true",
        help="records named as production names them (UUID job ids, long node names, slice "
        "metadata) instead of short ids: what the ledger keeps per job then",
    )
    parser.add_argument(
        "--baseline-lua",
        type=Path,
        default=None,
        help="another version's lua/ directory (git worktree add /tmp/base REV, then "
        "/tmp/base/libs/ledger/src/xpupool/ledger/lua): the same jobs run on a ledger of their "
        "own with those scripts, interleaved with this version's on the same server, and each "
        "script's median is given against the baseline's",
    )
    args = parser.parse_args()
    asyncio.run(main(args.nodes, args.jobs, Ids(args.production_ids), args.baseline_lua))
