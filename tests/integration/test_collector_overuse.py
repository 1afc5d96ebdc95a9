"""Over-use detection in an in-process collector against real nats-server and redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from xpupool.bus import BusSettings, Publisher, connect, ensure_streams
from xpupool.contracts import DeviceSample, LeaseOverused, Vendor, decoder_for, subjects
from xpupool.devices import DeviceInfo, ProcessInfo, SimulatedBackend, load_catalog, to_samples
from xpupool.devstack.servers import NatsServer
from xpupool.ledger import Ledger, Reservation, SliceClaim
from xpupool.telemetry_collector.handlers import CollectorDeps, collect, register_node
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.overuse import LeaseOfPid, read_lease_env
from xpupool.telemetry_collector.settings import CollectorSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@dataclass
class Bus:
    """A publisher on the test's NATS, and every LeaseOverused that reached the subject."""

    publisher: Publisher
    js: JetStreamContext
    seen: list[LeaseOverused] = field(default_factory=list)


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """A connected publisher with the streams declared, subscribed to over-use events."""
    nc = await connect(BusSettings(url=nats_server.url, name="test-collector"))
    js = nc.jetstream()
    await ensure_streams(js, subjects.STREAMS)
    result = Bus(Publisher(nc, source="/tests/collector"), js)
    decoder = decoder_for((LeaseOverused,))

    async def on_event(msg: Msg) -> None:
        result.seen.append(decoder.decode(msg.data))

    await nc.subscribe(subjects.LEASE_OVERUSED.subject(), cb=on_event)
    yield result
    await nc.drain()


class ProcessBackend:
    """One A100 whose memory and processes the test sets (a stand-in for NVML)."""

    def __init__(self, node_id: str, processes: list[ProcessInfo]) -> None:
        self.node_id = node_id
        self.vendor = Vendor.NVIDIA
        self.processes = processes
        self.discovered = 0

    def discover(self) -> list[DeviceInfo]:
        self.discovered += 1
        used = sum(p.memory_used_mib or 0 for p in self.processes)
        return [
            DeviceInfo(
                vendor=Vendor.NVIDIA,
                index=0,
                name="NVIDIA A100-SXM4-80GB",
                uuid="GPU-test-0",
                memory_total_mib=81_920,
                memory_used_mib=used,
                processes=self.processes,
            )
        ]

    def sample(self) -> list[DeviceSample]:
        return to_samples(self.discover(), self.node_id)

    def close(self) -> None:
        pass


async def collector(
    ledger: Ledger,
    backend: SimulatedBackend | ProcessBackend,
    lease_of_pid: LeaseOfPid = read_lease_env,
    **settings: float,
) -> CollectorDeps:
    deps = CollectorDeps(
        ledger=ledger,
        backend=backend,
        catalog=load_catalog(None),
        settings=CollectorSettings(node_id=backend.node_id, cpu_milli=8000, **settings),  # type: ignore[arg-type]
        health=HealthModel(missed_limit=3),
        lease_of_pid=lease_of_pid,
    )
    await register_node(deps)
    return deps


async def lease(ledger: Ledger, device_id: str, lease_id: str, memory_mib: int) -> None:
    slices = [SliceClaim(device_id=device_id, memory_mib=memory_mib, compute_pct=20)]
    reservation = Reservation(
        job_id=f"job-{lease_id}",
        lease_id=lease_id,
        tenant="t",
        queue="t",
        priority=0,
        owner="o",
        ttl_ms=60_000,
        hold_ms=60_000,
        slices=slices,
    )
    assert (await ledger.reserve(reservation)).ok
    assert (await ledger.grant(lease_id)).ok


async def ticks(deps: CollectorDeps, bus: Bus, n: int) -> None:
    for _ in range(n):
        await bus.publisher.publish_all(await collect(deps))
    await asyncio.sleep(0.1)  # let the core subscription deliver


async def test_overusing_simulated_lease_raises_one_event(ledger: Ledger, bus: Bus) -> None:
    """A share lease whose simulated device uses 1.5x its grant yields one LeaseOverused over
    NATS across many ticks; ending the lease ends the episode."""
    backend = SimulatedBackend("node-o", "1xA100-80GB", load_catalog(None))
    deps = await collector(ledger, backend, sim_overuse_factor=1.5)
    await lease(ledger, "node-o/nvidia0", "lease-over", 20_000)
    await ticks(deps, bus, 5)
    assert [(e.lease_id, e.job_id, e.device_id) for e in bus.seen] == [
        ("lease-over", "job-lease-over", "node-o/nvidia0")
    ]
    assert (bus.seen[0].granted_memory_mib, bus.seen[0].used_memory_mib) == (20_000, 30_000)
    stored = await bus.js.get_last_msg(
        subjects.EVENTS_STREAM.name, subjects.LEASE_OVERUSED.subject()
    )
    assert stored.data is not None
    assert msgspec.json.decode(stored.data)["lease_id"] == "lease-over"

    assert (await ledger.end("lease-over", "released")).ok
    await ticks(deps, bus, 2)
    assert deps.overuse.open == {} and deps.lease_cache == {}
    assert len(bus.seen) == 1


async def test_shared_device_charges_processes_by_lease(ledger: Ledger, bus: Bus) -> None:
    """With two leases on one device, only the lease whose own processes exceed its grant is
    reported, once, via the injected pid -> lease mapping."""
    processes = [
        ProcessInfo(pid=101, memory_used_mib=15_000),
        ProcessInfo(pid=202, memory_used_mib=26_000),
        ProcessInfo(pid=303, memory_used_mib=30_000),  # no lease known: charged to nobody
    ]
    backend = ProcessBackend("node-p", processes)
    owners = {101: "lease-a", 202: "lease-b"}
    deps = await collector(ledger, backend, owners.get)
    await lease(ledger, "node-p/nvidia0", "lease-a", 20_000)
    await lease(ledger, "node-p/nvidia0", "lease-b", 20_000)
    before = backend.discovered
    await ticks(deps, bus, 4)
    assert backend.discovered > before
    assert [(e.lease_id, e.used_memory_mib) for e in bus.seen] == [("lease-b", 26_000)]
