"""Parsers for ``nvidia-smi`` output: ``-q -x`` (XML), the default table, and ``topo -m``.

NVML (:mod:`xpupool.devices.nvml`) is the primary NVIDIA backend; these parsers let an operator
check saved outputs and serve as a fallback. Values printed as ``N/A`` become ``None``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Final

from msgspec import structs

from xpupool.contracts import Health, Vendor
from xpupool.devices._tools import inum, num
from xpupool.devices.backend import (
    DeviceInfo,
    EccCounts,
    PartitionInfo,
    ProcessInfo,
    assign_domains,
)
from xpupool.devices.topology import TopoMatrix, parse_topo_matrix

__all__ = ["apply_topology", "parse_nvidia_smi_table", "parse_nvidia_smi_xml", "parse_topo_matrix"]

_BUS_ID: Final = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_POWER: Final = re.compile(r"([\d.]+|N/A)\s*W?\s*/\s*([\d.]+|N/A)\s*W?")
_MEMORY: Final = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_DRIVER: Final = re.compile(r"Driver Version:\s*(\S+)")


# ---------------------------------------------------------------------------- -q -x XML ----


def _text(node: ET.Element | None, path: str) -> str | None:
    if node is None:
        return None
    found = node.find(path)
    if found is None or found.text is None:
        return None
    return " ".join(found.text.split())


def _sum_counts(node: ET.Element | None, kind: str) -> int | None:
    """Sum ``*_correctable``/``*_uncorrectable`` children (sram + dram), old and new layouts."""
    if node is None:
        return None
    values = [
        inum(child.text)
        for child in node.iter()
        if child.tag.endswith(kind) and child.text is not None
    ]
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _ecc(gpu: ET.Element) -> EccCounts | None:
    if (_text(gpu, "ecc_mode/current_ecc") or "").lower() != "enabled":
        return None
    volatile = gpu.find("ecc_errors/volatile")
    aggregate = gpu.find("ecc_errors/aggregate")
    return EccCounts(
        volatile_corrected=_sum_counts(volatile, "_correctable"),
        volatile_uncorrected=_sum_counts(volatile, "_uncorrectable"),
        aggregate_corrected=_sum_counts(aggregate, "_correctable"),
        aggregate_uncorrected=_sum_counts(aggregate, "_uncorrectable"),
    )


def _mig_mode(gpu: ET.Element) -> bool | None:
    current = (_text(gpu, "mig_mode/current_mig") or "").lower()
    return {"enabled": True, "disabled": False}.get(current)


def _partitions(gpu: ET.Element) -> list[PartitionInfo]:
    parts: list[PartitionInfo] = []
    for mig in gpu.findall("mig_devices/mig_device"):
        parts.append(
            PartitionInfo(
                index=inum(_text(mig, "index")) or 0,
                gpu_instance_id=inum(_text(mig, "gpu_instance_id")),
                compute_instance_id=inum(_text(mig, "compute_instance_id")),
                memory_total_mib=inum(_text(mig, "fb_memory_usage/total")),
                memory_used_mib=inum(_text(mig, "fb_memory_usage/used")),
            )
        )
    return parts


def _processes(gpu: ET.Element) -> list[ProcessInfo]:
    out: list[ProcessInfo] = []
    for proc in gpu.findall("processes/process_info"):
        pid = inum(_text(proc, "pid"))
        if pid is None:
            continue
        out.append(
            ProcessInfo(
                pid=pid,
                name=_text(proc, "process_name") or "",
                memory_used_mib=inum(_text(proc, "used_memory")),
                gpu_instance_id=inum(_text(proc, "gpu_instance_id")),
                compute_instance_id=inum(_text(proc, "compute_instance_id")),
            )
        )
    return out


def parse_nvidia_smi_xml(text: str) -> list[DeviceInfo]:
    """Parse ``nvidia-smi -q -x``: identity, memory, utilisation, temperatures, power and
    limit, SM clocks, ECC, MIG mode and MIG devices (as partitions), processes.

    Raises ``ValueError`` on malformed XML.
    """
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"not nvidia-smi XML: {exc}") from exc
    driver = _text(root, "driver_version") or ""
    devices: list[DeviceInfo] = []
    for position, gpu in enumerate(root.findall("gpu")):
        total = inum(_text(gpu, "fb_memory_usage/total"))
        power = gpu.find("power_readings")
        if power is None:
            power = gpu.find("gpu_power_readings")
        devices.append(
            DeviceInfo(
                vendor=Vendor.NVIDIA,
                index=position,
                name=_text(gpu, "product_name") or "unknown",
                uuid=_text(gpu, "uuid") or "",
                pci_bus_id=_text(gpu, "pci/pci_bus_id") or gpu.get("id") or "",
                serial=_text(gpu, "serial") or "",
                driver_version=driver,
                memory_total_mib=total,
                memory_used_mib=inum(_text(gpu, "fb_memory_usage/used")),
                memory_free_mib=inum(_text(gpu, "fb_memory_usage/free")),
                util_pct=num(_text(gpu, "utilization/gpu_util")),
                memory_util_pct=num(_text(gpu, "utilization/memory_util")),
                temperature_c=num(_text(gpu, "temperature/gpu_temp")),
                memory_temperature_c=num(_text(gpu, "temperature/memory_temp")),
                power_w=num(_text(power, "power_draw") or _text(power, "average_power_draw")),
                power_limit_w=num(
                    _text(power, "enforced_power_limit") or _text(power, "current_power_limit")
                ),
                sm_clock_mhz=inum(_text(gpu, "clocks/sm_clock")),
                sm_clock_max_mhz=inum(_text(gpu, "max_clocks/sm_clock")),
                ecc=_ecc(gpu),
                mig_mode=_mig_mode(gpu),
                partitions=_partitions(gpu),
                processes=_processes(gpu),
            )
        )
    return devices


# ------------------------------------------------------------------------ default table ----


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_nvidia_smi_table(text: str) -> list[DeviceInfo]:
    """Parse the default ``nvidia-smi`` table (the 535 three-row layout and the older two-row
    one); ``...`` elision lines are skipped. Volatile uncorrected ECC above zero makes a GPU
    unhealthy."""
    driver_match = _DRIVER.search(text)
    driver = driver_match.group(1) if driver_match else ""
    devices: list[DeviceInfo] = []
    current: DeviceInfo | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("|") or "Processes:" in line:
            if "Processes:" in line:
                break
            continue
        cells = _cells(line)
        if len(cells) < 3:
            continue
        bus = cells[1].split()[0] if cells[1].split() else ""
        if _BUS_ID.match(bus):
            if current is not None:
                devices.append(current)
            current = _first_row(cells, bus, driver)
        elif current is not None and "MiB" in cells[1]:
            current = _second_row(current, cells)
        elif current is not None and not cells[0] and not cells[1]:
            mig = cells[2].lower()
            current = structs.replace(
                current, mig_mode={"enabled": True, "disabled": False}.get(mig)
            )
    if current is not None:
        devices.append(current)
    return devices


def _first_row(cells: list[str], bus: str, driver: str) -> DeviceInfo:
    head = cells[0].split()
    # "0  NVIDIA H20  On": index, name words, persistence mode.
    name_tokens = head[1:-1] if len(head) > 2 and head[-1] in ("On", "Off") else head[1:]
    ecc = inum(cells[2])
    reasons = [f"{ecc} volatile uncorrectable ECC errors"] if ecc else []
    return DeviceInfo(
        vendor=Vendor.NVIDIA,
        index=int(head[0]),
        name=" ".join(name_tokens),
        pci_bus_id=bus,
        driver_version=driver,
        ecc=EccCounts(volatile_uncorrected=ecc) if ecc is not None else None,
        health=Health.UNHEALTHY if ecc else Health.HEALTHY,
        health_reasons=reasons,
    )


def _second_row(current: DeviceInfo, cells: list[str]) -> DeviceInfo:
    # "N/A   24C    P0    72W / 500W" | "0MiB / 97871MiB" | "0%   Default"
    power = _POWER.search(cells[0])
    singles = _POWER.sub(" ", cells[0]).split()
    memory = _MEMORY.search(cells[1])
    used = inum(memory.group(1)) if memory else None
    total = inum(memory.group(2)) if memory else None
    util = cells[2].split()
    return structs.replace(
        current,
        temperature_c=num(singles[1]) if len(singles) > 1 else None,
        power_w=num(power.group(1)) if power else None,
        power_limit_w=num(power.group(2)) if power else None,
        memory_used_mib=used,
        memory_total_mib=total,
        memory_free_mib=total - used if total is not None and used is not None else None,
        util_pct=num(util[0]) if util else None,
    )


# ------------------------------------------------------------------------------- topo -m ----


def apply_topology(devices: list[DeviceInfo], matrix: TopoMatrix) -> list[DeviceInfo]:
    """Attach ``topo -m`` links and CPU affinity to parsed GPUs and label NVLink domains."""
    linked = [
        structs.replace(
            d,
            links=matrix.links(f"GPU{d.index}"),
            cpu_affinity=matrix.cpu_affinity.get(f"GPU{d.index}", ""),
            numa_node=inum(matrix.numa_affinity.get(f"GPU{d.index}")),
        )
        for d in devices
    ]
    return assign_domains(linked, "nvlink")
