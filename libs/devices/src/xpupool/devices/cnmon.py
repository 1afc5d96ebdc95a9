"""Cambricon MLUs through ``cnmon``: a parser of its default table and a backend that runs it.

Two layouts exist. v5 (``CNMON v5.x … Driver v5.x``)::

    | Card  VF  Name       Firmware |               Bus-Id | Util        Ecc-Error |
    | Fan   Temp      Pwr:Usage/Cap |         Memory-Usage | SR-IOV   Compute-Mode |

v4 (``CNMON v4.x``) has ``Inited Driver`` instead of ``Bus-Id`` and ``vMemory-Usage`` in the last
column. Cells may be misaligned, a timestamp line may come first, and a process table follows.
"""

from __future__ import annotations

import re
from typing import Final

from msgspec import structs

from xpupool.contracts import DeviceSample, Health, Vendor
from xpupool.devices._tools import Runner, inum, num, subprocess_runner
from xpupool.devices.backend import BackendUnavailable, DeviceInfo, ProcessInfo, to_samples
from xpupool.devices.catalog import Catalog

__all__ = ["CnmonBackend", "parse_cnmon"]

_BUS_ID: Final = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_PAIR: Final = re.compile(r"([\d.]+)\s*(\w+)?\s*/\s*([\d.]+)\s*(\w+)?")
_DRIVER: Final = re.compile(r"Driver\s+v?(\S+)")
_CNMON: Final = re.compile(r"CNMON\s+v?(\S+)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_cnmon(text: str) -> list[DeviceInfo]:
    """Parse the default ``cnmon`` table (v5 or v4 layout) into one DeviceInfo per card entry.

    ``Ecc-Error`` above zero degrades a device (the count is in ``health_reasons``); cnmon
    prints no other health signal.
    """
    driver = _DRIVER.search(text) or _CNMON.search(text)
    version = driver.group(1) if driver else ""
    devices: list[DeviceInfo] = []
    pending: DeviceInfo | None = None
    processes: dict[int, list[ProcessInfo]] = {}
    in_processes = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("|"):
            continue
        if "Processes:" in line:
            in_processes = True
            continue
        cells = _cells(line)
        if in_processes:
            _process_row(cells, processes)
            continue
        if len(cells) < 3 or cells[0].startswith(("Card", "Fan", "CNMON")):
            continue
        head = cells[0].split()
        if head and head[0].isdigit() and "MiB" not in cells[1]:
            pending = _first_row(head, cells, version)
        elif pending is not None and "MiB" in cells[1]:
            devices.append(_second_row(pending, cells))
            pending = None
    return [structs.replace(d, processes=processes.get(d.index, [])) for d in devices]


def _first_row(head: list[str], cells: list[str], version: str) -> DeviceInfo:
    # head = [card, vf, name..., firmware]; vf is "/" on a physical function.
    name_tokens = head[2:-1] if len(head) > 3 else head[2:]
    bus = cells[1].split()[0] if cells[1].split() else ""
    if not _BUS_ID.match(bus):
        # v4: "Inited  Driver" (e.g. "On  v4.20.11"), no bus id.
        parts = cells[1].split()
        version = parts[-1].lstrip("v") if parts else version
        bus = ""
    util_ecc = cells[2].split()
    ecc = inum(util_ecc[1]) if len(util_ecc) > 1 else None
    health, reasons = Health.HEALTHY, []
    if ecc:
        health, reasons = Health.DEGRADED, [f"{ecc} ECC errors"]
    return DeviceInfo(
        vendor=Vendor.CAMBRICON,
        index=int(head[0]),
        card_index=int(head[0]),
        name=" ".join(name_tokens),
        pci_bus_id=bus,
        driver_version=version,
        util_pct=num(util_ecc[0]) if util_ecc else None,
        health=health,
        health_reasons=reasons,
    )


def _second_row(first: DeviceInfo, cells: list[str]) -> DeviceInfo:
    # "0%   41C         27 W/ 150 W" -> fan, temperature, power usage / cap
    fan_temp = _PAIR.sub(" ", cells[0]).split()
    power = _PAIR.search(cells[0])
    memory = _PAIR.search(cells[1])
    used = inum(memory.group(1)) if memory else None
    total = inum(memory.group(3)) if memory else None
    return structs.replace(
        first,
        temperature_c=num(fan_temp[1]) if len(fan_temp) > 1 else None,
        power_w=num(power.group(1)) if power else None,
        power_limit_w=num(power.group(3)) if power else None,
        memory_used_mib=used,
        memory_total_mib=total,
        memory_free_mib=total - used if total is not None and used is not None else None,
    )


def _process_row(cells: list[str], out: dict[int, list[ProcessInfo]]) -> None:
    tokens = cells[0].split()
    # "Card VF PID Command... <n> MiB"
    if len(tokens) < 5 or not tokens[0].isdigit() or not tokens[2].isdigit():
        return
    memory = inum(tokens[-2]) if tokens[-1].lower() == "mib" else None
    name = " ".join(tokens[3:-2] if memory is not None else tokens[3:])
    out.setdefault(int(tokens[0]), []).append(
        ProcessInfo(pid=int(tokens[2]), name=name, memory_used_mib=memory)
    )


class CnmonBackend:
    """Cambricon MLUs read through ``cnmon`` on PATH (one process per call)."""

    def __init__(
        self,
        node_id: str,
        catalog: Catalog,
        *,
        runner: Runner | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self._node_id = node_id
        self._catalog = catalog
        self._run = runner or subprocess_runner(timeout_s)

    @property
    def vendor(self) -> Vendor:
        """``Vendor.CAMBRICON``."""
        return Vendor.CAMBRICON

    @property
    def node_id(self) -> str:
        """The node id given at construction."""
        return self._node_id

    def discover(self) -> list[DeviceInfo]:
        """Every MLU entry of ``cnmon``. Raises BackendUnavailable if cnmon is missing, fails
        or lists nothing."""
        devices = parse_cnmon(self._run(["cnmon"]))
        if not devices:
            raise BackendUnavailable("cnmon listed no MLUs")
        return devices

    def sample(self) -> list[DeviceSample]:
        """Live readings from ``cnmon``."""
        return to_samples(self.discover(), self._node_id)

    def close(self) -> None:
        """Nothing to release."""
