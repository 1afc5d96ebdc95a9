"""Recognise and parse a saved vendor-tool output (for ``xpupool devices --fixtures`` and
tests): the kind is told from the content, so file names do not matter."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final, Literal

from msgspec import Struct, field

from xpupool.contracts import Vendor
from xpupool.devices.backend import DeviceInfo
from xpupool.devices.catalog import Catalog
from xpupool.devices.cnmon import parse_cnmon
from xpupool.devices.npu_smi import (
    NpuChipMapping,
    NpuDetail,
    parse_npu_smi_detail,
    parse_npu_smi_info,
    parse_npu_smi_mapping,
)
from xpupool.devices.nvidia_smi import parse_nvidia_smi_table, parse_nvidia_smi_xml
from xpupool.devices.rocm_smi import parse_rocm_smi_json
from xpupool.devices.topology import TopoMatrix, parse_topo_matrix

__all__ = ["OutputKind", "SavedOutput", "classify", "parse_saved", "parse_saved_dir"]

OutputKind = Literal[
    "nvidia-smi-xml",
    "nvidia-smi",
    "nvidia-smi-topo",
    "npu-smi-info",
    "npu-smi-mapping",
    "npu-smi-detail",
    "npu-smi-topo",
    "npu-smi-help",
    "cnmon",
    "rocm-smi-json",
    "unknown",
]

_NPU_TABLE: Final = re.compile(r"^\s*\|\s*NPU\s+.*\|\s*Health", re.MULTILINE)
_KV: Final = re.compile(r"^\s*[A-Za-z][^:\n]*\s:\s", re.MULTILINE)


class SavedOutput(Struct, frozen=True, kw_only=True):
    """One parsed file: its kind, the devices it lists (device tables only) and the parsed
    extra views (mapping, detail, topology)."""

    path: str
    kind: OutputKind
    vendor: Vendor | None = None
    devices: list[DeviceInfo] = field(default_factory=list)
    mapping: list[NpuChipMapping] = field(default_factory=list)
    detail: NpuDetail | None = None
    topology: TopoMatrix | None = None


def classify(text: str) -> OutputKind:
    """Tell which tool and view produced ``text``."""
    stripped = text.lstrip()
    if "<nvidia_smi_log" in text:
        return "nvidia-smi-xml"
    if stripped.startswith("{"):
        return "rocm-smi-json"
    if "NVIDIA-SMI" in text:
        return "nvidia-smi"
    if "CNMON" in text:
        return "cnmon"
    if "Usage: npu-smi" in text:
        return "npu-smi-help"
    if _NPU_TABLE.search(text):
        return "npu-smi-info"
    if "Chip Logic ID" in text:
        return "npu-smi-mapping"
    if "CPU Affinity" in text:
        return "nvidia-smi-topo" if re.search(r"\bGPU0\b", text) else "npu-smi-topo"
    if _KV.search(text):
        return "npu-smi-detail"
    return "unknown"


def parse_saved(path: Path, catalog: Catalog | None = None) -> SavedOutput:
    """Parse one saved output. Raises ``ValueError`` for unreadable JSON/XML."""
    text = path.read_text("utf-8", errors="replace")
    kind = classify(text)
    name = str(path)
    if kind == "nvidia-smi-xml":
        return SavedOutput(
            path=name, kind=kind, vendor=Vendor.NVIDIA, devices=parse_nvidia_smi_xml(text)
        )
    if kind == "nvidia-smi":
        return SavedOutput(
            path=name, kind=kind, vendor=Vendor.NVIDIA, devices=parse_nvidia_smi_table(text)
        )
    if kind == "rocm-smi-json":
        devices = parse_rocm_smi_json(text, catalog=catalog)
        vendor = devices[0].vendor if devices else Vendor.AMD
        return SavedOutput(path=name, kind=kind, vendor=vendor, devices=devices)
    if kind == "cnmon":
        return SavedOutput(path=name, kind=kind, vendor=Vendor.CAMBRICON, devices=parse_cnmon(text))
    if kind == "npu-smi-info":
        return SavedOutput(
            path=name, kind=kind, vendor=Vendor.ASCEND, devices=parse_npu_smi_info(text)
        )
    if kind == "npu-smi-mapping":
        return SavedOutput(
            path=name, kind=kind, vendor=Vendor.ASCEND, mapping=parse_npu_smi_mapping(text)
        )
    if kind == "npu-smi-detail":
        return SavedOutput(
            path=name, kind=kind, vendor=Vendor.ASCEND, detail=parse_npu_smi_detail(text)
        )
    if kind in ("nvidia-smi-topo", "npu-smi-topo"):
        vendor = Vendor.NVIDIA if kind == "nvidia-smi-topo" else Vendor.ASCEND
        return SavedOutput(path=name, kind=kind, vendor=vendor, topology=parse_topo_matrix(text))
    return SavedOutput(path=name, kind=kind, vendor=Vendor.ASCEND if "npu" in kind else None)


def parse_saved_dir(directory: Path, catalog: Catalog | None = None) -> list[SavedOutput]:
    """Parse every file below ``directory`` except Markdown notes, in path order."""
    return [
        parse_saved(p, catalog)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.suffix.lower() != ".md"
    ]
