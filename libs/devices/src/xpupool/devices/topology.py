"""Parser for the topology matrices of ``nvidia-smi topo -m`` and ``npu-smi info -t topo``.

Both print a header of column names (devices, NICs, then ``CPU Affinity`` and friends) and one
row per device with a path class per peer: ``X`` (self), ``NV18`` (18 NVLinks), ``HCCS``,
``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``. A legend may follow.
"""

from __future__ import annotations

import re
from typing import Final

from msgspec import Struct, field

from xpupool.devices.backend import LinkInfo

__all__ = ["TopoMatrix", "parse_topo_matrix"]

_COLUMN_SPLIT: Final = re.compile(r"\t+|\s{2,}")
# Terminal styling: nvidia-smi 580 underlines the header row even when its output is piped.
_ANSI_STYLE: Final = re.compile(r"\x1b\[[0-9;]*m")
_DEVICE: Final = re.compile(r"^(GPU|NPU|MLU)(\d+)$")
_NVLINK: Final = re.compile(r"^NV(\d+)$")


class TopoMatrix(Struct, frozen=True, kw_only=True):
    """The parsed matrix. ``paths[row][column]`` is the printed cell (``"NV18"``, ``"HCCS"``)."""

    columns: list[str]
    paths: dict[str, dict[str, str]] = field(default_factory=dict)
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        """Row names that are accelerators (``GPU0``, ``NPU3``), in order."""
        return [r for r in self.paths if _DEVICE.match(r)]

    def links(self, device: str) -> list[LinkInfo]:
        """Links from ``device`` to every other accelerator, kinds in lower case."""
        out: list[LinkInfo] = []
        for peer, cell in self.paths.get(device, {}).items():
            peer_match = _DEVICE.match(peer)
            if peer_match is None or peer == device or cell.upper() == "X":
                continue
            nv = _NVLINK.match(cell.upper())
            if nv:
                kind, lanes = "nvlink", int(nv.group(1))
            else:
                kind, lanes = cell.lower(), None
            out.append(LinkInfo(peer_index=int(peer_match.group(2)), kind=kind, lanes=lanes))
        return out


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse a topology matrix; tolerates a leading tab, NIC rows and a trailing legend."""
    lines = [line.rstrip() for line in _ANSI_STYLE.sub("", text).splitlines()]
    header_at = next((i for i, line in enumerate(lines) if line.strip()), None)
    if header_at is None:
        return TopoMatrix(columns=[])
    columns = [c for c in _COLUMN_SPLIT.split(lines[header_at].strip()) if c]
    paths: dict[str, dict[str, str]] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, str] = {}
    for line in lines[header_at + 1 :]:
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":").lower() == "legend":
            break
        row, values = tokens[0], tokens[1:]
        if row not in columns:
            continue
        cells = dict(zip(columns, values, strict=False))
        paths[row] = {c: v for c, v in cells.items() if c in columns and _is_peer(c)}
        if "CPU Affinity" in cells:
            cpu[row] = cells["CPU Affinity"]
        if "NUMA Affinity" in cells:
            numa[row] = cells["NUMA Affinity"]
    return TopoMatrix(columns=columns, paths=paths, cpu_affinity=cpu, numa_affinity=numa)


def _is_peer(column: str) -> bool:
    return " " not in column
