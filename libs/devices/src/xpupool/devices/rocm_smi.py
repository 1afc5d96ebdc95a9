"""AMD GPUs and Hygon DCUs through ``rocm-smi --json`` (Hygon also ships it as ``hy-smi``).

The output is ``{"cardN": {"<Label (unit)>": "<string>"}}``: every value is a string, and
labels and units differ by vendor and build (AMD ``VRAM Total Memory (B)`` and ``GPU use (%)``,
Hygon ``vram Total Memory (MiB)`` and ``DCU use (%)``, plus a stray ``"": ""``). Labels are
therefore matched case-insensitively by pattern and the unit is read from the label.
"""

from __future__ import annotations

import json
import re
from typing import Final

from xpupool.contracts import DeviceSample, Vendor
from xpupool.devices._tools import Runner, mib, num, subprocess_runner
from xpupool.devices.backend import BackendUnavailable, DeviceInfo, to_samples
from xpupool.devices.catalog import Catalog

__all__ = ["ROCM_SMI_ARGS", "RocmSmiBackend", "parse_rocm_smi_json"]

# The flags gpustack ran to produce the fixtures; labels below assume them.
ROCM_SMI_ARGS: Final = (
    "--showid", "--showmeminfo", "vram", "--showpower", "--showserial", "--showuse",
    "--showtemp", "--showproductname", "--showuniqueid", "--json",
)  # fmt: skip

_CARD: Final = re.compile(r"^card(\d+)$", re.IGNORECASE)
_UNIT: Final = re.compile(r"\((b|kib|mib|gib|mb)\)\s*$", re.IGNORECASE)
_NAME_KEYS: Final = ("card series", "device name", "card model", "card sku")
_MISSING: Final = frozenset({"", "N/A", "NA"})


def _find(fields: dict[str, str], pattern: str) -> tuple[str, str] | None:
    regex = re.compile(pattern, re.IGNORECASE)
    for key, value in fields.items():
        if regex.search(key):
            return key, value
    return None


def _memory(fields: dict[str, str], pattern: str) -> int | None:
    hit = _find(fields, pattern)
    if hit is None:
        return None
    unit = _UNIT.search(hit[0])
    return mib(hit[1], unit.group(1) if unit else "b")


def _vendor_of(fields: dict[str, str], default: Vendor) -> Vendor:
    maker = " ".join(v for k, v in fields.items() if k.lower() in ("card vendor", "vendor"))
    if re.search(r"haiguang|hygon", maker, re.IGNORECASE):
        return Vendor.HYGON
    if re.search(r"advanced micro devices|\bamd\b", maker, re.IGNORECASE):
        return Vendor.AMD
    return default


def _name(fields: dict[str, str], vendor: Vendor, catalog: Catalog | None) -> str:
    lowered = {k.lower(): v.strip() for k, v in fields.items()}
    candidates = [lowered[k] for k in _NAME_KEYS if lowered.get(k)]
    if catalog is not None:
        for candidate in candidates:
            entry = catalog.lookup(candidate)
            if entry is not None:
                return entry.name
        pci = lowered.get("device id", "")
        entry = catalog.lookup_pci(vendor, pci) if pci else None
        if entry is not None:
            return entry.name
    return candidates[0] if candidates else "unknown"


def parse_rocm_smi_json(
    text: str, *, vendor: Vendor = Vendor.AMD, catalog: Catalog | None = None
) -> list[DeviceInfo]:
    """Parse ``rocm-smi … --json``. The vendor comes from ``Card Vendor`` (else ``vendor``).

    With a ``catalog``, an anonymised product name (Hygon prints ``DCU xxxx``) is resolved
    through the other name labels and then the PCI ``Device ID``; without one the first
    printed name is kept. Raises ``ValueError`` on text that is not a JSON object.
    """
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("rocm-smi --json output is not an object")
    devices: list[DeviceInfo] = []
    for card, raw_fields in data.items():
        match = _CARD.match(card)
        if match is None or not isinstance(raw_fields, dict):
            continue
        fields = {str(k): str(v) for k, v in raw_fields.items() if str(k).strip()}
        card_vendor = _vendor_of(fields, vendor)
        total = _memory(fields, r"^vram total memory")
        used = _memory(fields, r"^vram total used memory")
        util = _find(fields, r"^(gpu|dcu) use \(%\)")
        edge = _find(fields, r"^temperature \(sensor edge\)")
        mem_temp = _find(fields, r"^temperature \(sensor mem(ory)?\)")
        power = _find(fields, r"graphics package power \(w\)")
        unique = fields.get("Unique ID", "")
        serial = fields.get("Serial Number", "")
        devices.append(
            DeviceInfo(
                vendor=card_vendor,
                index=int(match.group(1)),
                name=_name(fields, card_vendor, catalog),
                uuid="" if unique.upper() in _MISSING else unique,
                serial="" if serial.upper() in _MISSING else serial,
                memory_total_mib=total,
                memory_used_mib=used,
                memory_free_mib=total - used if total is not None and used is not None else None,
                util_pct=num(util[1]) if util else None,
                temperature_c=num(edge[1]) if edge else None,
                memory_temperature_c=num(mem_temp[1]) if mem_temp else None,
                power_w=num(power[1]) if power else None,
            )
        )
    return sorted(devices, key=lambda d: d.index)


class RocmSmiBackend:
    """AMD GPUs or Hygon DCUs read through ``rocm-smi`` (or ``hy-smi``) on PATH."""

    def __init__(
        self,
        node_id: str,
        catalog: Catalog,
        *,
        vendor: Vendor = Vendor.AMD,
        tool: str = "rocm-smi",
        runner: Runner | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._node_id = node_id
        self._catalog = catalog
        self._vendor = vendor
        self._tool = tool
        self._run = runner or subprocess_runner(timeout_s)

    @property
    def vendor(self) -> Vendor:
        """The vendor given at construction (each device reports its own)."""
        return self._vendor

    @property
    def node_id(self) -> str:
        """The node id given at construction."""
        return self._node_id

    def discover(self) -> list[DeviceInfo]:
        """Every card in ``rocm-smi --json``. Raises BackendUnavailable when the tool is
        missing, fails, prints something that is not JSON, or lists no card."""
        text = self._run([self._tool, *ROCM_SMI_ARGS])
        try:
            devices = parse_rocm_smi_json(text, vendor=self._vendor, catalog=self._catalog)
        except ValueError as exc:
            raise BackendUnavailable(f"{self._tool} printed unreadable JSON: {exc}") from exc
        if not devices:
            raise BackendUnavailable(f"{self._tool} listed no cards")
        return devices

    def sample(self) -> list[DeviceSample]:
        """Live readings from the same command."""
        return to_samples(self.discover(), self._node_id)

    def close(self) -> None:
        """Nothing to release."""
