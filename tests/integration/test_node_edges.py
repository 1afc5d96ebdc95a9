"""Edges of a node's life in the ledger that real hardware brings: a GPU that recovered while
its collector was down, a unit replaced under the same device id (a MIG instance made again),
driven through an in-process collector or the ledger's scripts against a real redis-server."""

from __future__ import annotations

import msgspec
import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceSample, DeviceSpec, Health, Vendor
from xpupool.devices import DeviceInfo, PartitionInfo, load_catalog, to_samples
from xpupool.ledger import Ledger, SliceClaim
from xpupool.ledger.audit import audit
from xpupool.telemetry_collector.handlers import CollectorDeps, collect, register_node
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.settings import CollectorSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


class GpuBackend:
    """One NVIDIA GPU whose reading the test sets (a stand-in for NVML)."""

    def __init__(self, node_id: str, info: DeviceInfo) -> None:
        self.node_id = node_id
        self.vendor = Vendor.NVIDIA
        self.info = info

    def discover(self) -> list[DeviceInfo]:
        return [self.info]

    def sample(self) -> list[DeviceSample]:
        return to_samples(self.discover(), self.node_id)

    def close(self) -> None:
        pass


def collector(ledger: Ledger, backend: GpuBackend, **settings: float) -> CollectorDeps:
    """A fresh collector process for ``backend``'s node (its own health model, no state)."""
    return CollectorDeps(
        ledger=ledger,
        backend=backend,
        catalog=load_catalog(None),
        settings=CollectorSettings(node_id=backend.node_id, cpu_milli=8000, **settings),  # type: ignore[arg-type]
        health=HealthModel(missed_limit=3),
    )


async def health_of(ledger: Ledger, node_id: str, device_id: str) -> Health:
    return {d.spec.device_id: d.health for d in await ledger.node_devices(node_id)}[device_id]


A100 = DeviceInfo(
    vendor=Vendor.NVIDIA,
    index=0,
    name="NVIDIA A100-SXM4-80GB",
    uuid="GPU-edge-0",
    memory_total_mib=81_920,
    memory_used_mib=0,
)


async def test_a_gpu_that_recovered_while_its_collector_was_down_takes_grants_again(
    ledger: Ledger,
) -> None:
    """NVML keeps a hardware XID sticky only in the process that saw it: after the operator
    resets the GPU and restarts the collector, the backend reads it healthy. The ledger must
    say so too; a fresh collector's health model starts at healthy and sees no transition, so
    a registration that keeps the old 'unhealthy' leaves the GPU out of service for good."""
    backend = GpuBackend("edge-1", msgspec.structs.replace(A100, health=Health.UNHEALTHY, xid=79))
    first = collector(ledger, backend)
    await register_node(first)
    await collect(first)
    assert await health_of(ledger, "edge-1", "edge-1/nvidia0") is Health.UNHEALTHY

    backend.info = A100  # reset, and the collector restarted: a new process, a new model
    second = collector(ledger, backend)
    await register_node(second)
    for _ in range(2):
        await collect(second)
    assert await health_of(ledger, "edge-1", "edge-1/nvidia0") is Health.HEALTHY
    assert (
        await ledger.reserve(reservation("after-reset", SliceClaim("edge-1/nvidia0", 1024, 10)))
    ).ok


async def test_registration_never_shows_an_unhealthy_gpu_as_healthy(ledger: Ledger) -> None:
    """A node the lease-manager declared lost registers again with a GPU that is unhealthy now:
    the script that brings the node back writes the backend's health with it, so no reservation
    can land on the GPU between the registration and a later correction."""
    backend = GpuBackend("edge-2", A100)
    deps = collector(ledger, backend)
    await register_node(deps)
    await ledger.redis.hset(ledger.key("node", "edge-2"), "last_seen_ms", 0)
    assert (await ledger.reap_nodes(1)).lost == ["edge-2"]

    backend.info = msgspec.structs.replace(A100, health=Health.UNHEALTHY, xid=79)
    await register_node(deps)
    assert await health_of(ledger, "edge-2", "edge-2/nvidia0") is Health.UNHEALTHY
    refused = await ledger.reserve(reservation("too-soon", SliceClaim("edge-2/nvidia0", 1024, 10)))
    assert not refused.ok and refused.reason == "device_unhealthy"


def mig_spec(node: str, uuid: str, share: float) -> DeviceSpec:
    """``<node>/nvidia0/mig1.0``: a MIG instance with GPU instance 1, compute instance 0."""
    return msgspec.structs.replace(
        device_spec(node, 0, 19_968),
        device_id=f"{node}/nvidia0/mig1.0",
        uuid=uuid,
        capacity_units=share,
        parent_uuid="GPU-parent",
    )


async def test_a_unit_registered_again_under_another_uuid_ends_the_leases_of_the_one_it_replaced(
    ledger: Ledger,
) -> None:
    """MIG instance ids are reused: destroying GPU instance 1 and making an instance again,
    which the driver numbers 1 again, gives a new MIG-<uuid> under the same device id (and,
    for another profile, another share). The
    leases on the old instance hold a unit that is gone (their holders were given its UUID);
    they end as lost and the new instance joins free."""
    old = mig_spec("edge-3", "MIG-old", 3 / 7)
    assert (await ledger.register_node("edge-3", [old], 8000, 64_000)).ok
    assert (await ledger.reserve(reservation("whole", SliceClaim(old.device_id, whole=True)))).ok

    same = await ledger.register_node("edge-3", [old], 8000, 64_000)
    assert same.ok and same.lost == []  # the same unit: its lease lives on

    new = mig_spec("edge-3", "MIG-new", 4 / 7)
    result = await ledger.register_node("edge-3", [new], 8000, 64_000)
    assert result.ok and result.lost == ["lease-whole"]
    lease = await ledger.get_lease("lease-whole")
    assert lease is not None and lease.end_reason == "lost"
    [device] = await ledger.node_devices("edge-3")
    assert device.spec.uuid == "MIG-new"
    assert (device.holders, device.exclusive, device.memory_free_mib) == (0, False, 19_968)
    assert await audit(ledger) == []


async def test_a_mig_instance_made_again_while_the_collector_runs_is_registered_again(
    ledger: Ledger,
) -> None:
    """The samples of a remade MIG instance keep the ledger's ids, so only reading the devices
    whole shows the change: the collector does so every spec_check_interval_s and registers
    the node again, ending the lease on the old instance and listing the new UUID (what the
    next holder's CUDA_VISIBLE_DEVICES gets)."""

    def a100_mig(uuid: str, profile: str) -> DeviceInfo:
        part = PartitionInfo(
            index=0,
            uuid=uuid,
            profile=profile,
            gpu_instance_id=1,
            compute_instance_id=0,
            memory_total_mib=19_968,
            memory_used_mib=0,
        )
        return msgspec.structs.replace(
            A100, name="NVIDIA A100-SXM4-40GB", mig_mode=True, partitions=[part]
        )

    backend = GpuBackend("edge-4", a100_mig("MIG-old", "3g.20gb"))
    deps = collector(ledger, backend, spec_check_interval_s=0.0)
    await register_node(deps)
    unit = "edge-4/nvidia0/mig1.0"
    assert (await ledger.reserve(reservation("on-mig", SliceClaim(unit, whole=True)))).ok
    await collect(deps)
    lease = await ledger.get_lease("lease-on-mig")
    assert lease is not None and lease.state == "reserved"  # nothing changed: it lives on

    # `nvidia-smi mig -dci -dgi`, then `mig -cgi 3g.20gb -C`: the same ids, a new instance.
    backend.info = a100_mig("MIG-new", "3g.20gb")
    await collect(deps)
    lease = await ledger.get_lease("lease-on-mig")
    assert lease is not None and lease.end_reason == "lost"
    [device] = await ledger.node_devices("edge-4")
    assert device.spec.uuid == "MIG-new" and device.holders == 0
    assert device.spec.partition is not None and device.spec.partition.profile == "3g.20gb"
    assert await audit(ledger) == []


async def test_two_collectors_under_one_node_id_leave_it_to_the_last_to_register(
    ledger: Ledger,
) -> None:
    """A cloned host, or a copied ``XPUPOOL_NODE_ID``: two live collectors heartbeat one node.
    Before, each kept the node alive for the other and their loads overwrote each other. The
    last to register holds the node (as a restarted collector takes over from its dead
    predecessor); the other's ticks are refused ``node_claimed``, write nothing and do not
    register again, which would take the node back only for it to be taken back in turn."""
    first = collector(ledger, GpuBackend("edge-c", A100))
    await register_node(first)
    await collect(first)
    second = collector(ledger, GpuBackend("edge-c", A100))
    assert second.instance != first.instance
    await register_node(second)
    await collect(second)

    node, device = ledger.key("node", "edge-c"), ledger.key("dev", "edge-c/nvidia0")
    busy = msgspec.structs.replace(A100, util_pct=97.0)
    first.backend.info = busy  # type: ignore[attr-defined]
    seen_before = await ledger.redis.hget(node, "last_seen_ms")
    util_before = await ledger.redis.hget(device, "util")
    for _ in range(3):
        assert await collect(first) == []
    assert await ledger.redis.hget(node, "instance") == second.instance.encode()
    assert await ledger.redis.hget(node, "last_seen_ms") == seen_before
    assert await ledger.redis.hget(device, "util") == util_before
    second.backend.info = busy  # type: ignore[attr-defined]
    await collect(second)  # the holder's reading of the same load is written
    assert await ledger.redis.hget(device, "util") != util_before
    claimed = first.metrics.registry.get_sample_value(
        "xpupool_collector_samples_total", {"outcome": "node_claimed"}
    )
    assert claimed == 3
    refused = await ledger.heartbeat("edge-c", (), first.instance)
    assert not refused.ok and refused.reason == "node_claimed"
    assert refused.detail == second.instance
    assert (await ledger.heartbeat("edge-c", (), second.instance)).ok
    assert (await ledger.heartbeat("edge-c")).ok  # no instance named: not checked
