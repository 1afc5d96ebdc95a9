"""The backend protocol every device source implements, its rich ``DeviceInfo`` type, and the
conversion from ``DeviceInfo`` to the wire types (``DeviceSpec``, ``DeviceSample``).

Backends are synchronous: the collector calls them from a worker thread. A backend that cannot
run (tool missing, library absent, node killed) raises :class:`BackendUnavailable` with a message
meant for an operator, never a raw traceback.
"""

from __future__ import annotations

import hashlib
import re
import uuid as uuid_mod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from msgspec import Struct, field, structs

from xpupool.contracts import DeviceSample, DeviceSpec, Health, PartitionSpec, Vendor

if TYPE_CHECKING:
    from xpupool.devices.catalog import Catalog

__all__ = [
    "APPLICATION_XIDS",
    "MIG_SLICES",
    "BackendUnavailable",
    "DeviceBackend",
    "DeviceInfo",
    "EccCounts",
    "LinkInfo",
    "PartitionInfo",
    "ProcessInfo",
    "assign_domains",
    "device_id_for",
    "partition_id_for",
    "stable_uuid",
    "to_sample",
    "to_samples",
    "to_spec",
    "to_specs",
    "worst_health",
    "xid_health",
]

# NVIDIA's k8s-device-plugin (internal/rm/health.go, applicationErrorXids) treats these as faults
# of the application, not of the GPU: the device stays schedulable.
APPLICATION_XIDS: Final[frozenset[int]] = frozenset({13, 31, 43, 45, 68})

# GPU slices of a MIG-capable board (A100, H100, H200: up to seven instances).
MIG_SLICES: Final = 7
# A MIG profile as NVML names it: "3g.20gb", or "1c.3g.20gb" for a split compute instance.
_MIG_PROFILE: Final = re.compile(r"^(?:(\d+)c\.)?(\d+)g\.(\d+)gb$")

# Interconnect classes that form a peer-to-peer domain; "pcie" devices never share one.
_DOMAIN_KINDS: Final[frozenset[str]] = frozenset({"nvlink", "nvswitch", "hccs", "mlu-link"})

_HEALTH_ORDER: Final[dict[Health, int]] = {
    Health.HEALTHY: 0,
    Health.DEGRADED: 1,
    Health.UNHEALTHY: 2,
    Health.LOST: 3,
}


class BackendUnavailable(RuntimeError):
    """A backend cannot run here: its tool or library is missing, or it failed. The message is
    written for an operator (e.g. ``npu-smi not found on PATH``)."""


class EccCounts(Struct, frozen=True, kw_only=True):
    """ECC error counters; ``None`` means the board does not report that counter."""

    volatile_corrected: int | None = None
    volatile_uncorrected: int | None = None
    aggregate_corrected: int | None = None
    aggregate_uncorrected: int | None = None


class ProcessInfo(Struct, frozen=True, kw_only=True):
    """A process holding device memory (PIDs are in the host PID namespace)."""

    pid: int
    name: str = ""
    memory_used_mib: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class LinkInfo(Struct, frozen=True, kw_only=True):
    """One path from this device to a peer, as the vendor topology reports it.

    ``kind`` is lower case: ``nvlink``, ``hccs``, ``mlu-link``, or a PCIe path class
    (``pix``, ``pxb``, ``phb``, ``node``, ``sys``). ``lanes`` is the link count (``NV18`` -> 18).
    """

    peer_index: int
    kind: str
    lanes: int | None = None


class PartitionInfo(Struct, frozen=True, kw_only=True):
    """A hardware partition that is leased on its own: a MIG instance, a vNPU, an MLU MIM."""

    index: int
    uuid: str = ""
    profile: str = ""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    # Compute slices of the parent this partition owns, e.g. 3 of 7 for MIG 3g.20gb, 1 for
    # 1c.3g.20gb; gpu_slices is the GPU instance's share (the "3g": memory and engines).
    slices: int | None = None
    slices_total: int | None = None
    gpu_slices: int | None = None


class DeviceInfo(Struct, frozen=True, kw_only=True):
    """Everything a backend knows about one physical device (one chip for multi-chip cards).

    Values a device does not report are ``None`` (never a made-up zero). ``index`` is the index
    the vendor runtime uses (CUDA ordinal, Ascend chip logic id, MLU card), so it is what
    backend visibility variables take. ``card_index``/``chip_index`` keep the vendor's physical
    (card, chip) address for multi-chip boards.
    """

    vendor: Vendor
    index: int
    name: str
    uuid: str = ""
    pci_bus_id: str = ""
    card_index: int | None = None
    chip_index: int | None = None
    serial: str = ""
    driver_version: str = ""
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    memory_free_mib: int | None = None
    util_pct: float | None = None
    memory_util_pct: float | None = None
    temperature_c: float | None = None
    memory_temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    ecc: EccCounts | None = None
    health: Health = Health.HEALTHY
    health_reasons: list[str] = field(default_factory=list)
    xid: int | None = None
    mig_mode: bool | None = None
    partitions: list[PartitionInfo] = field(default_factory=list)
    processes: list[ProcessInfo] = field(default_factory=list)
    links: list[LinkInfo] = field(default_factory=list)
    cpu_affinity: str = ""
    numa_node: int | None = None
    # Local name of the peer-to-peer domain (e.g. "nvlink0"); to_spec prefixes the node id.
    domain: str = ""


@runtime_checkable
class DeviceBackend(Protocol):
    """What the collector needs from a device source. All calls are blocking."""

    @property
    def vendor(self) -> Vendor:
        """The vendor this backend reports (``simulated`` for the simulator)."""
        ...

    @property
    def node_id(self) -> str:
        """The node the devices belong to; part of every device id."""
        ...

    def discover(self) -> list[DeviceInfo]:
        """Enumerate the devices present now, with identity and a full reading."""
        ...

    def sample(self) -> list[DeviceSample]:
        """Read live load of every leasable unit (whole devices or their partitions)."""
        ...

    def close(self) -> None:
        """Release library handles; the backend is unusable afterwards."""
        ...


def device_id_for(node_id: str, vendor: Vendor, index: int) -> str:
    """The cluster-wide id of a whole device: ``{node_id}/{vendor}{index}``."""
    return f"{node_id}/{vendor.value}{index}"


def partition_id_for(parent_id: str, part: PartitionInfo) -> str:
    """The id of a partition: ``{parent}/mig{gi}.{ci}`` or ``{parent}/part{index}``."""
    if part.gpu_instance_id is not None:
        ci = part.compute_instance_id if part.compute_instance_id is not None else 0
        return f"{parent_id}/mig{part.gpu_instance_id}.{ci}"
    return f"{parent_id}/part{part.index}"


def stable_uuid(*parts: str) -> str:
    """A UUID derived only from ``parts``, for devices whose vendor reports no UUID."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return str(uuid_mod.UUID(bytes=digest[:16], version=5))


def xid_health(xid: int) -> Health:
    """Health after an XID: application XIDs leave the GPU healthy, all others make it unhealthy."""
    return Health.HEALTHY if xid in APPLICATION_XIDS else Health.UNHEALTHY


def worst_health(*states: Health) -> Health:
    """The most severe of ``states`` (healthy < degraded < unhealthy < lost)."""
    return max(states, key=_HEALTH_ORDER.__getitem__, default=Health.HEALTHY)


def _uuid_of(info: DeviceInfo, node_id: str) -> str:
    return info.uuid or stable_uuid(node_id, info.vendor.value, str(info.index), info.pci_bus_id)


def _capabilities(info: DeviceInfo, catalog: Catalog) -> list[str]:
    entry = catalog.lookup(info.name)
    return list(entry.capability_list()) if entry is not None else []


def to_spec(info: DeviceInfo, node_id: str, catalog: Catalog) -> DeviceSpec:
    """The whole device as a leasable unit, with catalog data (model, capacity, cost).

    A device the catalog does not know keeps its printed name as model, capacity 1.0 and
    cost 0; the collector should warn about it.
    """
    entry = catalog.lookup(info.name)
    memory = info.memory_total_mib
    if memory is None and entry is not None:
        memory = entry.memory_visible_mib
    return DeviceSpec(
        device_id=device_id_for(node_id, info.vendor, info.index),
        vendor=info.vendor,
        model=entry.name if entry is not None else info.name,
        index=info.index,
        uuid=_uuid_of(info, node_id),
        memory_mib=memory or 0,
        capacity_units=entry.capacity_units if entry is not None else 1.0,
        capabilities=_capabilities(info, catalog),
        isolation=list(entry.isolation) if entry is not None else [],
        interconnect=entry.interconnect if entry is not None else "pcie",
        domain=f"{node_id}/{info.domain}" if info.domain else "",
        cost_per_hour=entry.cost_per_hour if entry is not None else 0.0,
    )


def to_specs(infos: Iterable[DeviceInfo], node_id: str, catalog: Catalog) -> list[DeviceSpec]:
    """Every leasable unit: each MIG/vNPU partition of a partitioned device, else the device.

    A partition's capacity and cost are the parent's times its compute share (slices/total).
    A MIG-enabled GPU without instances yields nothing (:func:`_unusable`).
    """
    specs: list[DeviceSpec] = []
    for info in infos:
        if _unusable(info):
            continue
        whole = to_spec(info, node_id, catalog)
        if not (info.mig_mode and info.partitions):
            specs.append(whole)
            continue
        entry = catalog.lookup(info.name)
        for part in info.partitions:
            profile = part.profile
            if not profile and entry is not None:
                profile = entry.profile_for_memory(part.memory_total_mib) or ""
            share = _partition_share(part, entry.partition_share(profile) if entry else None)
            specs.append(
                DeviceSpec(
                    device_id=partition_id_for(whole.device_id, part),
                    vendor=info.vendor,
                    # The base model, so selectors on model keep matching; the cut is in
                    # partition, the share in memory_mib and capacity_units.
                    model=whole.model,
                    index=info.index,
                    uuid=part.uuid or stable_uuid(whole.uuid, str(part.index)),
                    memory_mib=part.memory_total_mib or 0,
                    capacity_units=round(whole.capacity_units * share, 4),
                    capabilities=whole.capabilities,
                    isolation=["mig"] if info.vendor is Vendor.NVIDIA else ["vnpu"],
                    interconnect=whole.interconnect,
                    domain=whole.domain,
                    cost_per_hour=round(whole.cost_per_hour * share, 4),
                    parent_uuid=whole.uuid,
                    partition=_partition_spec(info.vendor, part, profile),
                )
            )
    return specs


def _unusable(info: DeviceInfo) -> bool:
    """A GPU in MIG mode with no instance (MIG just enabled, or every instance destroyed): no
    CUDA process can use it whole and there is nothing to lease in it, so it is no unit until
    an instance is made (a lease on it would give its holder a UUID that shows no device)."""
    return bool(info.mig_mode) and not info.partitions


def _partition_spec(vendor: Vendor, part: PartitionInfo, profile: str) -> PartitionSpec:
    """The wire form of a partition's cut; MIG slice counts the backend did not read come from
    the profile name (``1c.3g.20gb``: 3 GPU slices, 1 compute slice, of 7)."""
    gpu, compute, total = part.gpu_slices, part.slices, part.slices_total
    mig = _MIG_PROFILE.match(profile) if vendor is Vendor.NVIDIA else None
    if mig is not None:
        named_gpu = int(mig.group(2))
        gpu = gpu if gpu is not None else named_gpu
        compute = compute if compute is not None else int(mig.group(1) or named_gpu)
        total = total if total is not None else MIG_SLICES
    return PartitionSpec(
        kind="mig" if vendor is Vendor.NVIDIA else "vnpu",
        profile=profile,
        gpu_slices=gpu,
        compute_slices=compute,
        slices_total=total,
        gpu_instance_id=part.gpu_instance_id,
        compute_instance_id=part.compute_instance_id,
    )


def _partition_share(part: PartitionInfo, from_profile: float | None) -> float:
    if part.slices is not None and part.slices_total:
        return part.slices / part.slices_total
    return from_profile if from_profile is not None else 1.0


def to_sample(info: DeviceInfo, node_id: str) -> DeviceSample:
    """The live reading of the whole device."""
    return DeviceSample(
        device_id=device_id_for(node_id, info.vendor, info.index),
        memory_used_mib=info.memory_used_mib,
        util_pct=info.util_pct,
        temperature_c=info.temperature_c,
        power_w=info.power_w,
        health=info.health,
        xid=info.xid,
    )


def to_samples(infos: Iterable[DeviceInfo], node_id: str) -> list[DeviceSample]:
    """Samples for every leasable unit, matching :func:`to_specs` one for one.

    Partitions inherit the parent's health, temperature and XID (they share the silicon);
    utilization is ``None`` because NVML does not report it per MIG instance.
    """
    samples: list[DeviceSample] = []
    for info in infos:
        if _unusable(info):
            continue
        whole = to_sample(info, node_id)
        if not (info.mig_mode and info.partitions):
            samples.append(whole)
            continue
        for part in info.partitions:
            samples.append(
                DeviceSample(
                    device_id=partition_id_for(whole.device_id, part),
                    memory_used_mib=part.memory_used_mib,
                    util_pct=None,
                    temperature_c=whole.temperature_c,
                    power_w=None,
                    health=whole.health,
                    xid=whole.xid,
                )
            )
    return samples


def assign_domains(infos: Sequence[DeviceInfo], interconnect: str) -> list[DeviceInfo]:
    """Label devices joined by ``interconnect``-class links with a shared local domain.

    Devices are grouped into connected components over links whose kind is a domain kind
    (nvlink/hccs/mlu-link); components are numbered by their lowest device index, so the
    labels are stable across restarts. Devices without such links get no domain.
    """
    if interconnect not in _DOMAIN_KINDS:
        return list(infos)
    by_index = {info.index: info for info in infos}
    parent = {i: i for i in by_index}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    linked: set[int] = set()
    for info in infos:
        for link in info.links:
            if link.kind in _DOMAIN_KINDS and link.peer_index in by_index:
                linked.update((info.index, link.peer_index))
                a, b = find(info.index), find(link.peer_index)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots = sorted({find(i) for i in linked})
    label = {root: f"{interconnect}{n}" for n, root in enumerate(roots)}
    return [
        structs.replace(info, domain=label[find(info.index)]) if info.index in linked else info
        for info in infos
    ]
