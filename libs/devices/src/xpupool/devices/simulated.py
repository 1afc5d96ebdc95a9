"""A simulated node for tests, demos and benchmarks.

``SimulatedBackend("node-a", "2xA100-80GB,4xAscend910B", catalog)`` behaves like a node with those
devices: their memory and utilisation follow the load the collector reports through
:meth:`SimulatedBackend.set_load`, and faults can be injected (XID, overheating, a device that
disappears, the whole node dying). Everything is deterministic for a given ``seed``.

``A100-80GB:mig=3g.40gb+2g.20gb+1g.10gb`` simulates GPUs in MIG mode with those instances (each
a leasable unit with a ``MIG-…`` UUID, as NVML reports them); the profiles must be ones the
catalog lists for the model, within its seven GPU slices.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from typing import Final

from msgspec import Struct, structs

from xpupool.contracts import DeviceSample, DeviceSpec, Health, Vendor
from xpupool.devices.backend import (
    MIG_SLICES,
    BackendUnavailable,
    DeviceInfo,
    LinkInfo,
    PartitionInfo,
    device_id_for,
    partition_id_for,
    stable_uuid,
    to_samples,
    to_specs,
    worst_health,
    xid_health,
)
from xpupool.devices.catalog import Catalog, CatalogEntry

__all__ = [
    "Disappear",
    "Fault",
    "NodeKilled",
    "Overheat",
    "SimulatedBackend",
    "Xid",
    "parse_profile",
]

_ITEM: Final = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?([^,]+?)\s*$")
_MIG_OPTION: Final = re.compile(r"^\s*([^:]+?)\s*:\s*mig\s*=\s*([^:]+?)\s*$", re.IGNORECASE)
_MIG_PROFILE: Final = re.compile(r"^(\d+)g\.(\d+)gb$")
_DOMAIN_KINDS: Final = frozenset({"nvlink", "nvswitch", "hccs", "mlu-link"})
_IDLE_POWER_SHARE: Final = 0.15


class Xid(Struct, frozen=True, kw_only=True):
    """An NVIDIA XID error (other vendors' critical errors are simulated the same way).
    Codes 13/31/43/45/68 are application errors and leave the device healthy."""

    code: int


class Overheat(Struct, frozen=True, kw_only=True):
    """The device runs hot; above the backend's threshold it reports ``degraded``.
    ``None`` means ten degrees over the threshold."""

    temperature_c: float | None = None


class Disappear(Struct, frozen=True, kw_only=True):
    """The device falls off the bus: it drops out of ``discover`` and ``sample``."""


Fault = Xid | Overheat | Disappear


class NodeKilled(BackendUnavailable):
    """The simulated node is dead (``kill_node``); every call fails until ``revive_node``."""


class ProfileError(ValueError):
    """A node profile that cannot be simulated: malformed, or a model not in the catalog."""


def parse_profile(profile: str) -> list[tuple[int, str]]:
    """Parse ``"2xA100-80GB,4xAscend910B"`` into ``[(2, "A100-80GB"), (4, "Ascend910B")]``.

    A count may be omitted (``"T4"`` = one). Raises ``ValueError`` on an empty profile or a
    count below 1 (``ProfileError``, a ``ValueError``).
    """
    items: list[tuple[int, str]] = []
    for part in profile.split(","):
        if not part.strip():
            continue
        match = _ITEM.match(part)
        if match is None:
            raise ProfileError(f"bad device profile item {part!r}")
        count = int(match.group(1)) if match.group(1) else 1
        if count < 1:
            raise ProfileError(f"device count must be at least 1 in {part!r}")
        items.append((count, match.group(2)))
    if not items:
        raise ProfileError("empty device profile; expected e.g. '2xA100-80GB,4xAscend910B'")
    return items


class _SimDevice:
    """Mutable state of one simulated device; guarded by the backend's lock."""

    def __init__(self, info: DeviceInfo, entry: CatalogEntry, idle_temp_c: float) -> None:
        self.info: Final = info
        self.entry: Final = entry
        self.idle_temp_c: Final = idle_temp_c
        self.memory_used_mib = 0
        self.compute_pct = 0
        self.faults: list[Fault] = []
        # Memory used per MIG instance, by the instance's unit id.
        self.partition_used_mib: dict[str, int] = {}


def _split_mig(model: str, entry_of: Callable[[str], CatalogEntry]) -> tuple[str, list[str]]:
    """``"A100-80GB:mig=3g.40gb+1g.10gb"`` -> ``("A100-80GB", ["3g.40gb", "1g.10gb"])``,
    checked against the catalog entry of the model; no option -> ``(model, [])``."""
    match = _MIG_OPTION.match(model)
    if match is None:
        if ":" in model:
            raise ProfileError(f"bad device option in {model!r}; expected MODEL:mig=3g.40gb+...")
        return model, []
    name = match.group(1)
    profiles = [p.strip().lower() for p in match.group(2).split("+")]
    entry = entry_of(name)
    if "mig" not in entry.isolation:
        raise ProfileError(f"{entry.name} has no MIG (catalog isolation {entry.isolation})")
    slices = 0
    for profile in profiles:
        parsed = _MIG_PROFILE.match(profile)
        if parsed is None or profile not in entry.partition_profiles:
            known = ", ".join(entry.partition_profiles)
            raise ProfileError(f"MIG profile {profile!r} not listed for {entry.name}: {known}")
        slices += int(parsed.group(1))
    if slices > MIG_SLICES:
        raise ProfileError(f"MIG profiles {profiles} need {slices} of {MIG_SLICES} GPU slices")
    return name, profiles


def _mig_instance(parent_uuid: str, slot: int, profile: str) -> PartitionInfo:
    parsed = _MIG_PROFILE.match(profile)
    if parsed is None:
        raise ProfileError(f"bad MIG profile {profile!r}")
    slices, gb = int(parsed.group(1)), int(parsed.group(2))
    return PartitionInfo(
        index=slot,
        uuid="MIG-" + stable_uuid(parent_uuid, "mig", str(slot)),
        profile=profile,
        # Real GPU instance ids depend on where the driver places an instance; sequential ids
        # keep unit ids stable and distinct, which is all the simulation needs.
        gpu_instance_id=slot + 1,
        compute_instance_id=0,
        memory_total_mib=gb * 1024,
        slices=slices,
        slices_total=MIG_SLICES,
        gpu_slices=slices,
    )


class SimulatedBackend:
    """A :class:`~xpupool.devices.backend.DeviceBackend` whose devices exist only in memory.

    Devices keep the vendor of their catalog model (an A100 is ``nvidia``), numbered per vendor
    in profile order; the backend itself reports ``Vendor.SIMULATED``. Thread-safe: the
    collector samples from a worker thread while tests inject faults from another.
    """

    def __init__(
        self,
        node_id: str,
        profile: str,
        catalog: Catalog,
        seed: int = 0,
        *,
        temperature_threshold_c: float = 85.0,
    ) -> None:
        self._node_id = node_id
        self._catalog = catalog
        self._threshold_c = temperature_threshold_c
        self._lock = threading.Lock()
        self._killed = False
        self._closed = False
        self._devices: dict[str, _SimDevice] = {}
        self._partition_parent: dict[str, str] = {}
        self._build(parse_profile(profile), random.Random(seed))

    def _entry(self, model: str) -> CatalogEntry:
        entry = self._catalog.lookup(model)
        if entry is None:
            known = ", ".join(e.name for e in self._catalog)
            raise ProfileError(f"unknown device model {model!r}; known: {known}")
        return entry

    def _build(self, items: list[tuple[int, str]], rng: random.Random) -> None:
        next_index: dict[Vendor, int] = {}
        next_domain: dict[str, int] = {}
        for count, item in items:
            model, mig = _split_mig(item, self._entry)
            entry = self._entry(model)
            kind = entry.interconnect
            first_domain = next_domain.get(kind, 0)
            size = max(entry.domain_size, 1)
            group: list[tuple[int, int]] = []
            for n in range(count):
                index = next_index.get(entry.vendor, 0)
                next_index[entry.vendor] = index + 1
                group.append((index, first_domain + n // size))
            if kind in _DOMAIN_KINDS:
                next_domain[kind] = first_domain + -(-count // size)
            for index, domain_no in group:
                peers = [i for i, d in group if d == domain_no and i != index]
                info = self._make_info(entry, index, domain_no, peers, mig)
                device_id = device_id_for(self._node_id, entry.vendor, index)
                dev = _SimDevice(info, entry, 30.0 + rng.uniform(0.0, 6.0))
                self._devices[device_id] = dev
                for part in info.partitions:
                    unit = partition_id_for(device_id, part)
                    dev.partition_used_mib[unit] = 0
                    self._partition_parent[unit] = device_id

    def _make_info(
        self, entry: CatalogEntry, index: int, domain_no: int, peers: list[int], mig: list[str]
    ) -> DeviceInfo:
        raw = stable_uuid("simulated", self._node_id, entry.vendor.value, str(index))
        in_domain = entry.interconnect in _DOMAIN_KINDS
        link_kind = "nvlink" if entry.interconnect == "nvswitch" else entry.interconnect
        partitions = [_mig_instance(raw, slot, profile) for slot, profile in enumerate(mig)]
        return DeviceInfo(
            vendor=entry.vendor,
            index=index,
            name=entry.aliases[0] if entry.aliases else entry.name,
            uuid=f"GPU-{raw}" if entry.vendor is Vendor.NVIDIA else raw,
            pci_bus_id=f"0000:{0x10 + index:02X}:00.0",
            memory_total_mib=entry.memory_visible_mib or entry.memory_nominal_mib or 0,
            power_limit_w=entry.tdp_w,
            links=[LinkInfo(peer_index=p, kind=link_kind) for p in peers] if in_domain else [],
            domain=f"{entry.interconnect}{domain_no}" if in_domain else "",
            mig_mode=True if partitions else None,
            partitions=partitions,
        )

    @property
    def vendor(self) -> Vendor:
        """Always ``Vendor.SIMULATED``; each device carries its model's real vendor."""
        return Vendor.SIMULATED

    @property
    def node_id(self) -> str:
        """The node id given at construction."""
        return self._node_id

    @property
    def device_ids(self) -> list[str]:
        """Ids of all devices, present or not, in profile order."""
        return list(self._devices)

    @property
    def unit_ids(self) -> list[str]:
        """Ids of every leasable unit, present or not: a MIG-mode GPU's instances in its place."""
        units: list[str] = []
        for device_id, dev in self._devices.items():
            units.extend(dev.partition_used_mib or [device_id])
        return units

    def _check_alive(self) -> None:
        if self._closed:
            raise BackendUnavailable("simulated backend is closed")
        if self._killed:
            raise NodeKilled(f"simulated node {self._node_id} is down")

    def _device(self, device_id: str) -> _SimDevice:
        try:
            return self._devices[device_id]
        except KeyError:
            raise KeyError(f"no simulated device {device_id!r} on {self._node_id}") from None

    def _reading(self, dev: _SimDevice) -> DeviceInfo:
        info, entry = dev.info, dev.entry
        total = info.memory_total_mib or 0
        partitions = [
            structs.replace(part, memory_used_mib=used)
            for part, used in zip(info.partitions, dev.partition_used_mib.values(), strict=True)
        ]
        used = min(
            sum(dev.partition_used_mib.values()) if partitions else dev.memory_used_mib, total
        )
        temperature = dev.idle_temp_c + 0.45 * dev.compute_pct
        health = Health.HEALTHY
        reasons: list[str] = []
        xid: int | None = None
        for fault in dev.faults:
            if isinstance(fault, Xid):
                xid = fault.code
                health = worst_health(health, xid_health(fault.code))
                reasons.append(f"xid {fault.code}")
            elif isinstance(fault, Overheat):
                temperature = fault.temperature_c or self._threshold_c + 10.0
        if temperature > self._threshold_c:
            health = worst_health(health, Health.DEGRADED)
            reasons.append(f"temperature {temperature:.1f} C above {self._threshold_c:.1f} C")
        power: float | None = None
        if entry.tdp_w is not None:
            share = _IDLE_POWER_SHARE + (1 - _IDLE_POWER_SHARE) * dev.compute_pct / 100
            power = round(entry.tdp_w * share, 1)
        return DeviceInfo(
            vendor=info.vendor,
            index=info.index,
            name=info.name,
            uuid=info.uuid,
            pci_bus_id=info.pci_bus_id,
            memory_total_mib=total,
            memory_used_mib=used,
            memory_free_mib=total - used,
            # Like NVML, a GPU in MIG mode reports no utilisation.
            util_pct=None if partitions else float(dev.compute_pct),
            temperature_c=round(temperature, 1),
            power_w=power,
            power_limit_w=info.power_limit_w,
            health=health,
            health_reasons=reasons,
            xid=xid,
            links=info.links,
            domain=info.domain,
            mig_mode=info.mig_mode,
            partitions=partitions,
        )

    def discover(self) -> list[DeviceInfo]:
        """Present devices with their current reading. Raises :class:`NodeKilled` when dead."""
        with self._lock:
            self._check_alive()
            return [
                self._reading(dev)
                for dev in self._devices.values()
                if not any(isinstance(f, Disappear) for f in dev.faults)
            ]

    def specs(self) -> list[DeviceSpec]:
        """The present devices as wire ``DeviceSpec`` (catalog model, capacity, cost, domain)."""
        return to_specs(self.discover(), self._node_id, self._catalog)

    def sample(self) -> list[DeviceSample]:
        """Live samples of present devices. Raises :class:`NodeKilled` when the node is dead."""
        return to_samples(self.discover(), self._node_id)

    def set_load(self, device_id: str, memory_used_mib: int, compute_pct: int) -> None:
        """Set what the device is doing (what the collector has leased out on it).

        Memory is capped at the device's total and compute at 0..100, as a real device would
        report. ``device_id`` may be a MIG instance's unit id: its memory is set (capped at the
        instance's) and ``compute_pct`` ignored, since NVML reports no per-instance load.
        Raises ``KeyError`` for an unknown device and ``ValueError`` for negative load.
        """
        if memory_used_mib < 0 or compute_pct < 0:
            raise ValueError("load must not be negative")
        with self._lock:
            parent = self._partition_parent.get(device_id)
            if parent is not None:
                dev = self._devices[parent]
                slot = list(dev.partition_used_mib).index(device_id)
                cap = dev.info.partitions[slot].memory_total_mib or 0
                dev.partition_used_mib[device_id] = min(memory_used_mib, cap)
                return
            dev = self._device(device_id)
            dev.memory_used_mib = memory_used_mib
            dev.compute_pct = min(compute_pct, 100)

    def inject(self, device_id: str, fault: Fault) -> None:
        """Add a fault to a device; it stays until :meth:`clear`."""
        with self._lock:
            self._device(device_id).faults.append(fault)

    def clear(self, device_id: str) -> None:
        """Remove every fault of a device (a disappeared device comes back)."""
        with self._lock:
            self._device(device_id).faults.clear()

    def kill_node(self) -> None:
        """Make every call fail with :class:`NodeKilled`, as if the node went down."""
        with self._lock:
            self._killed = True

    def revive_node(self) -> None:
        """Bring a killed node back; device faults and load are kept."""
        with self._lock:
            self._killed = False

    def close(self) -> None:
        """Mark the backend closed; later calls raise :class:`BackendUnavailable`."""
        with self._lock:
            self._closed = True
