"""The demo: a small heterogeneous simulated fleet, a burst of mixed jobs, a short report.

Runs on embedded nats-server and redis-server unless ``XPUPOOL_NATS_URL``/``XPUPOOL_REDIS_URL``
are set, and leaves no process behind, Ctrl-C included. By default the embedded servers are
open on loopback (INSECURE, for development); ``secure=True`` (``xpupool demo --secure``) runs
the secure configuration instead: TLS, one NKey per service and per tenant, Redis ACLs, and
each tenant submitting with its own credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from xpupool.client import TenantEvent, XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    JobPending,
    JobRejected,
    JobRequested,
    JobTimedOut,
    Vendor,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger, audit

DEFAULT_FLEET = [
    NodeSpec("node-a", "2xA100-80GB"),
    NodeSpec("node-b", "4xAscend910B"),
    NodeSpec("node-c", "2xT4,1xMLU370-X4"),
]
BURST = 60
TENANTS = ("team-0", "team-1", "team-2")
AUTOSCALED_POOL = "t4-burst"
#: The demo's autoscaled pool: simulated 2xT4 nodes that the burst's T4 jobs make the
#: autoscaler add, removed again once idle past a short cool-down.
POOLS_YAML = f"""pools:
  - name: {AUTOSCALED_POOL}
    node: {{model: T4, count: 2, cpu_milli: 16000, memory_mib: 65536}}
    min_size: 0
    max_size: 2
    provisioning_delay_s: 2
    scale_down: {{cooldown_s: 6, low_watermark: 0.5}}
    provider: {{type: simulated}}
"""


def burst(size: int = BURST) -> list[JobRequested]:
    """A reproducible mix: whole devices, shares, gangs, vendor pins, and bad requests."""
    shapes: list[tuple[str, dict[str, Any]]] = [
        ("whole", {}),
        ("share", {"device": DeviceDemand(memory_mib=8192, compute_pct=25)}),
        ("quarter", {"device": DeviceDemand(memory_pct=25)}),
        (
            "ascend-gang",
            {"count": 2, "gang": GangSpec(), "selector": DeviceSelector(vendor=Vendor.ASCEND)},
        ),
        (
            "mlu-share",
            {
                "device": DeviceDemand(compute_pct=50),
                "selector": DeviceSelector(vendor=Vendor.CAMBRICON),
            },
        ),
        ("t4", {"selector": DeviceSelector(models=["T4"])}),
    ]
    requests = []
    for i in range(size):
        name, fields = shapes[i % len(shapes)]
        requests.append(
            JobRequested(
                job_id=f"demo-{i:03d}-{name}",
                tenant=TENANTS[i % len(TENANTS)],
                lease_ttl_s=20.0,
                max_wait_s=15.0,
                **fields,
            )
        )
    requests.append(JobRequested(job_id="demo-impossible", tenant="team-0", count=64))
    return requests


async def _drive(stack: Stack) -> int:
    assert stack.nats_url and stack.redis_url
    redis = Redis.from_url(stack.redis_url)
    ledger = Ledger(redis, stack.namespace)
    try:
        expected = 9
        deadline = time.monotonic() + 30
        while sum(len(n.devices) for n in await ledger.nodes()) < expected:
            if time.monotonic() > deadline:
                print("the fleet did not register in 30 s; see logs in", stack.workdir)
                return 1
            await asyncio.sleep(0.1)
        # Measure the pool, not the services' start-up: wait until they pull their streams.
        await stack.wait_until_pulling()
        mode = "SECURE (TLS, NKeys, ACLs)" if stack.secure else "INSECURE loopback (no auth)"
        print(f"mode: {mode}")
        print(f"fleet: {', '.join(f'{n.node_id}={n.profile}' for n in stack.nodes)}")
        async with contextlib.AsyncExitStack() as clients:
            by_tenant = {
                tenant: await clients.enter_async_context(stack.client(tenant))
                for tenant in TENANTS
            }
            sizes: list[int] = []
            sampler = (
                asyncio.create_task(_sample_pool(redis, ledger, sizes))
                if stack.autoscalers
                else None
            )
            try:
                code = await _burst(by_tenant, ledger)
                if sampler is not None:
                    code = max(code, await _scaled_back(redis, ledger, sizes))
                return code
            finally:
                if sampler is not None:
                    sampler.cancel()
    finally:
        await redis.aclose()


async def _pool_size(redis: Redis, ledger: Ledger) -> int | None:
    """Ready plus provisioning nodes of the demo's pool, from the autoscaler's last status."""
    from xpupool.autoscaler.status import decode_status

    raw = await redis.get(ledger.key("autoscaler", "status"))
    if raw is None:
        return None
    for pool in decode_status(raw if isinstance(raw, bytes) else raw.encode()).pools:
        if pool.name == AUTOSCALED_POOL:
            return sum(1 for n in pool.nodes if n.state in ("ready", "provisioning", "draining"))
    return None


async def _sample_pool(redis: Redis, ledger: Ledger, sizes: list[int]) -> None:
    while True:
        size = await _pool_size(redis, ledger)
        if size is not None:
            sizes.append(size)
        await asyncio.sleep(0.5)


async def _scaled_back(
    redis: Redis, ledger: Ledger, sizes: list[int], timeout_s: float = 40.0
) -> int:
    """Wait for the pool to shrink back to its minimum after the burst; report both."""
    peak = max(sizes, default=0)
    deadline = time.monotonic() + timeout_s
    size = await _pool_size(redis, ledger)
    while size and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        size = await _pool_size(redis, ledger)
    after = "not reported" if size is None else f"{size} after its cool-down"
    print(f"autoscaler     pool {AUTOSCALED_POOL}: 0 -> {peak} nodes under the burst, {after}")
    return 0 if peak > 0 and size == 0 else 1


async def _burst(clients: dict[str, XpupoolClient], ledger: Ledger) -> int:
    requests = burst()
    sent: dict[str, float] = {}
    owner = {r.job_id: clients[r.tenant or TENANTS[0]] for r in requests}
    futures = {r.job_id: owner[r.job_id].expect(r.job_id) for r in requests}
    bad = b'{"job_id": "demo-bad", "device": {"compute_pct": 400}}'
    owner["demo-bad"] = clients[TENANTS[0]]
    futures["demo-bad"] = owner["demo-bad"].expect("demo-bad")
    # Outcomes are stamped when they arrive, not when this coroutine gets round to them.
    arrived: dict[str, float] = {}
    for job_id, future in futures.items():
        future.add_done_callback(functools.partial(_stamp, arrived, job_id))
    started = time.perf_counter()
    waited: set[str] = set()

    def on_event(event: TenantEvent) -> None:
        if isinstance(event, JobPending):
            waited.add(event.job_id)

    for client in clients.values():
        client.listen(on_event)
    for r in requests:
        sent[r.job_id] = time.perf_counter()
        await owner[r.job_id].submit(r)
    sent["demo-bad"] = time.perf_counter()
    await owner["demo-bad"].submit_raw(bad, msg_id="demo-bad")

    latencies: list[float] = []
    immediate: list[float] = []
    outcomes: dict[str, object] = {}

    async def settle(job_id: str) -> None:
        outcome = await futures[job_id]
        outcomes[job_id] = outcome
        if isinstance(outcome, AllocationGranted):
            latency = arrived[job_id] - sent[job_id]
            latencies.append(latency)
            if job_id not in waited:
                immediate.append(latency)
            await asyncio.sleep(1.0)  # the "job" runs, then gives its slices back
            await owner[job_id].release(outcome.lease_id, outcome.fencing_token)

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(settle(j) for j in futures)), timeout=45)
    elapsed = time.perf_counter() - started
    granted = [o for o in outcomes.values() if isinstance(o, AllocationGranted)]
    rejected = [o for o in outcomes.values() if isinstance(o, JobRejected)]
    timed_out = [o for o in outcomes.values() if isinstance(o, JobTimedOut)]
    problems = await audit(ledger)
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [0.0] * 99
    print(f"submitted      {len(futures)} requests in a burst ({elapsed:.1f} s to settle)")
    print(f"granted        {len(granted)}")
    for rejection in rejected:
        what = f"{rejection.reason} {rejection.field_name or ''} {rejection.detail}"
        print(f"rejected       {rejection.job_id}: {what}".rstrip())
    print(f"timed out      {len(timed_out)}")
    print(f"no outcome     {len(futures) - len(outcomes)}")
    print(
        f"submit->grant  p50 {quantiles[49] * 1000:.1f} ms, p99 {quantiles[98] * 1000:.1f} ms "
        f"(all grants, queueing included)"
    )
    if immediate:
        print(
            f"               {statistics.median(immediate) * 1000:.1f} ms median for the "
            f"{len(immediate)} placed on arrival, max {max(immediate) * 1000:.1f} ms"
        )
    print(f"ledger audit   {problems if problems else 'consistent'}")
    return 0 if not problems and len(outcomes) == len(futures) else 1


def _stamp(arrived: dict[str, float], job_id: str, _: object) -> None:
    arrived.setdefault(job_id, time.perf_counter())


def run_demo(secure: bool = False) -> int:
    """Start the stack, run the burst, print the report, stop everything."""
    servers: dict[str, Any] = (
        {"secure": True, "tenants": TENANTS}
        if secure
        else {
            "nats_url": os.environ.get("XPUPOOL_NATS_URL"),
            "redis_url": os.environ.get("XPUPOOL_REDIS_URL"),
        }
    )
    env = {"XPUPOOL_LOG_LEVEL": "warning", "XPUPOOL_AUTOSCALER_INTERVAL_S": "1"}
    pools = Path(tempfile.mkdtemp(prefix="xpupool-demo-pools-")) / "pools.yaml"
    pools.write_text(POOLS_YAML, encoding="utf-8")
    scaling: dict[str, Any] = {"autoscalers": 1, "pools_file": str(pools)}
    stack = Stack(
        nodes=DEFAULT_FLEET,
        namespace=os.environ.get("XPUPOOL_NAMESPACE", f"demo-{os.getpid()}"),
        extra_env=env,
        **scaling,
        **servers,
    )
    # SIGTERM stops the demo as Ctrl-C does, through the same clean stop.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        stack.start()
        return asyncio.run(_drive(stack))
    except KeyboardInterrupt:
        print("interrupted; stopping")
        return 130
    finally:
        stack.stop()
