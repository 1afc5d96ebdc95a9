"""Huawei Ascend through ``npu-smi``: pure parsers of its outputs and a backend that runs it.

Ascend addresses a chip three ways: the NPU ID (card), the Chip ID on that card, and the Chip
Logic ID (what CANN and torch_npu enumerate, from ``npu-smi info -m``). ``DeviceInfo.index`` is
the logic id when known; ``card_index``/``chip_index`` keep the physical address. ``Mcu`` rows
(the board controller) are never devices.

npu-smi prints memory in "MB" that are MiB (a 64 GB 910B shows 65536), so values are kept as is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from msgspec import Struct, field, structs

from xpupool.contracts import DeviceSample, Health, Vendor
from xpupool.devices._tools import Runner, health_from_word, inum, num, subprocess_runner
from xpupool.devices.backend import (
    BackendUnavailable,
    DeviceInfo,
    EccCounts,
    ProcessInfo,
    assign_domains,
    to_samples,
    worst_health,
)
from xpupool.devices.catalog import Catalog
from xpupool.devices.topology import parse_topo_matrix

__all__ = [
    "NpuChipDetail",
    "NpuChipMapping",
    "NpuDetail",
    "NpuSmiBackend",
    "parse_npu_smi_detail",
    "parse_npu_smi_info",
    "parse_npu_smi_mapping",
]

_BUS_ID: Final = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")
_PAIR: Final = re.compile(r"(\S+)\s*/\s*(\S+)")
_VERSION: Final = re.compile(r"Version:\s*(\S+)")
_MAPPING_SPLIT: Final = re.compile(r"\s{2,}|\t+")


# ------------------------------------------------------------------------- npu-smi info ----


class _Card(Struct, kw_only=True):
    npu_id: int
    name: str
    health: str
    power_w: float | None
    temperature_c: float | None


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _pairs(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Split a cell into its single values and its ``used / total`` pairs, in order."""
    pairs = _PAIR.findall(text)
    singles = _PAIR.sub(" ", text).split()
    return singles, pairs


def _usage(pair: tuple[str, str] | None) -> tuple[int | None, int | None]:
    if pair is None:
        return None, None
    return inum(pair[0]), inum(pair[1])


def parse_npu_smi_info(text: str) -> list[DeviceInfo]:
    """Parse the ``npu-smi info`` table (every driver generation in the fixtures).

    Handles multi-chip cards, missing Hugepages/HBM columns, ``NA`` power, ``...`` elision,
    anonymised names and the process table. Memory is HBM when the chip has HBM, else its
    DDR/LPDDR. ``index`` is the ``Device`` column when printed, else the chip's position in
    the table; :class:`NpuSmiBackend` replaces it with the logic id from ``info -m``.
    """
    version_match = _VERSION.search(text)
    version = version_match.group(1) if version_match else ""
    chips: list[DeviceInfo] = []
    processes: dict[tuple[int, int], list[ProcessInfo]] = {}
    card: _Card | None = None
    in_processes = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if "Process id" in line or "Process name" in line:
            in_processes = True
            continue
        if in_processes:
            _parse_process_row(cells, processes)
            continue
        if len(cells) < 3 or cells[0].startswith(("NPU", "Chip", "npu-smi")):
            continue
        if _BUS_ID.match(cells[1].split()[0] if cells[1] else ""):
            if card is not None:
                chips.append(_chip(card, cells, len(chips), version))
        else:
            card = _card(cells)
    return [
        structs.replace(c, processes=processes.get((c.card_index or 0, c.chip_index or 0), []))
        for c in chips
    ]


def _card(cells: list[str]) -> _Card | None:
    head = cells[0].split()
    npu_id = inum(head[0]) if head else None
    if npu_id is None:
        return None
    singles, _ = _pairs(cells[2])
    return _Card(
        npu_id=npu_id,
        name=" ".join(head[1:]),
        health=cells[1],
        power_w=num(singles[0]) if singles else None,
        temperature_c=num(singles[1]) if len(singles) > 1 else None,
    )


def _chip(card: _Card, cells: list[str], position: int, version: str) -> DeviceInfo:
    head = cells[0].split()
    chip_id = inum(head[0]) if head else None
    device = inum(head[1]) if len(head) > 1 else None
    singles, pairs = _pairs(cells[2])
    mem_used, mem_total = _usage(pairs[0] if pairs else None)
    hbm_used, hbm_total = _usage(pairs[1] if len(pairs) > 1 else None)
    # 910/910B keep model memory in HBM (DDR is the control CPU's); 310/310P have only DDR.
    if hbm_total:
        mem_used, mem_total = hbm_used, hbm_total
    health, reasons = health_from_word(card.health)
    return DeviceInfo(
        vendor=Vendor.ASCEND,
        index=device if device is not None else position,
        name=card.name,
        pci_bus_id=cells[1].split()[0],
        card_index=card.npu_id,
        chip_index=chip_id,
        driver_version=version,
        memory_total_mib=mem_total,
        memory_used_mib=mem_used,
        memory_free_mib=mem_total - mem_used
        if mem_total is not None and mem_used is not None
        else None,
        util_pct=num(singles[0]) if singles else None,
        temperature_c=card.temperature_c,
        power_w=card.power_w,
        health=health,
        health_reasons=reasons,
    )


def _parse_process_row(cells: list[str], out: dict[tuple[int, int], list[ProcessInfo]]) -> None:
    if len(cells) < 4:
        return
    head = cells[0].split()
    pid = inum(cells[1])
    if len(head) < 2 or pid is None:
        return
    npu, chip = inum(head[0]), inum(head[1])
    if npu is None or chip is None:
        return
    out.setdefault((npu, chip), []).append(
        ProcessInfo(pid=pid, name=cells[2], memory_used_mib=inum(cells[3]))
    )


# ---------------------------------------------------------------------- npu-smi info -m ----


class NpuChipMapping(Struct, frozen=True, kw_only=True):
    """One row of ``npu-smi info -m``; ``logic_id`` is ``None`` for Mcu rows."""

    npu_id: int
    chip_id: int
    logic_id: int | None
    name: str

    @property
    def is_mcu(self) -> bool:
        """The board controller, not an accelerator."""
        return self.logic_id is None or self.name.lower() == "mcu"


def parse_npu_smi_mapping(text: str) -> list[NpuChipMapping]:
    """Parse ``npu-smi info -m`` (NPU ID, Chip ID, Chip Logic ID, Chip Name), Mcu rows included."""
    rows: list[NpuChipMapping] = []
    for raw in text.splitlines():
        parts = [p for p in _MAPPING_SPLIT.split(raw.strip()) if p]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        npu, chip = int(parts[0]), inum(parts[1])
        if chip is None:
            continue
        rows.append(
            NpuChipMapping(npu_id=npu, chip_id=chip, logic_id=inum(parts[2]), name=parts[3])
        )
    return rows


# ------------------------------------------------------- npu-smi info -t <type> (key : value) --


class NpuChipDetail(Struct, frozen=True, kw_only=True):
    """One chip's block of a ``-t usages|common|ecc|board|health`` output.

    Memory prefers HBM over DDR as in :func:`parse_npu_smi_info`; ``usages`` gives only a usage
    rate, so used memory is capacity x rate. ``fields`` keeps every printed key.
    """

    chip_id: int | None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    aicore_pct: float | None = None
    util_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    aicore_count: int | None = None
    health: Health | None = None
    health_reasons: list[str] = field(default_factory=list)
    ecc: EccCounts | None = None
    fields: dict[str, str] = field(default_factory=dict)


class NpuDetail(Struct, frozen=True, kw_only=True):
    """A whole ``-t`` output: card-level keys, one entry per chip, and the MCU block."""

    npu_id: int | None
    chip_count: int | None
    fields: dict[str, str] = field(default_factory=dict)
    chips: list[NpuChipDetail] = field(default_factory=list)
    mcu: dict[str, str] = field(default_factory=dict)

    @property
    def pci_device_id(self) -> str | None:
        """``PCI Device ID`` of a ``-t board -i N`` output (``0xD801`` = Ascend 910)."""
        return self.fields.get("PCI Device ID")


def _kv_blocks(text: str) -> list[dict[str, str]]:
    blocks: list[dict[str, str]] = [{}]
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            if blocks[-1]:
                blocks.append({})
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        # In `usages`/`ecc` output "Chip ID" closes a chip's block, in `common` it opens one;
        # a repeated key means a new block even without a blank line.
        if key in blocks[-1]:
            blocks.append({})
        blocks[-1][key] = value
    return [b for b in blocks if b]


def _rate_of(capacity: int | None, rate: float | None) -> int | None:
    if capacity is None or rate is None:
        return None
    return round(capacity * rate / 100)


def _chip_detail(block: dict[str, str]) -> NpuChipDetail:
    hbm_total = inum(block.get("HBM Capacity(MB)"))
    ddr_total = inum(block.get("DDR Capacity(MB)"))
    total: int | None
    if hbm_total:
        total, used = hbm_total, _rate_of(hbm_total, num(block.get("HBM Usage Rate(%)")))
    else:
        total, used = ddr_total, _rate_of(ddr_total, num(block.get("DDR Usage Rate(%)")))
    health: Health | None = None
    reasons: list[str] = []
    if "Health Status" in block:
        health, reasons = health_from_word(block["Health Status"])
        code = block.get("Error Code", "NA")
        if num(code) is not None and code.strip() not in ("0", "NA"):
            reasons.append(f"error code {code}")
    return NpuChipDetail(
        chip_id=inum(block.get("Chip ID")),
        memory_total_mib=total,
        memory_used_mib=used,
        aicore_pct=num(block.get("Aicore Usage Rate(%)")),
        util_pct=num(block.get("NPU Utilization(%)", block.get("Aicore Usage Rate(%)"))),
        temperature_c=num(block.get("Temperature(C)")),
        power_w=num(block.get("NPU Real-time Power(W)")),
        aicore_count=inum(block.get("Aicore Count")),
        health=health,
        health_reasons=reasons,
        ecc=_ecc(block),
        fields=block,
    )


def _ecc(block: dict[str, str]) -> EccCounts | None:
    keys = [k for k in block if "Bit" in k and ("Error Count" in k or "Err Cnt" in k)]
    if not keys:
        return None

    def total(kind: str, aggregate: bool) -> int | None:
        picked = [inum(block[k]) for k in keys if kind in k and (("Aggregate" in k) == aggregate)]
        values = [v for v in picked if v is not None]
        return sum(values) if values else None

    return EccCounts(
        volatile_corrected=total("Single Bit", False),
        volatile_uncorrected=total("Double Bit", False),
        aggregate_corrected=total("Single Bit", True),
        aggregate_uncorrected=total("Double Bit", True),
    )


def parse_npu_smi_detail(text: str) -> NpuDetail:
    """Parse any key/value ``npu-smi info -t TYPE`` output (usages, common, ecc, board, health,
    memory): leading tabs are ignored, ``Chip ID`` may open or close a chip block, and a
    ``Chip Name : mcu`` block is kept apart. Output without a ``Chip ID`` (``-t board -i N``,
    ``-t health``) yields card-level ``fields`` and, for health, a single chip entry."""
    card: dict[str, str] = {}
    chips: list[NpuChipDetail] = []
    mcu: dict[str, str] = {}
    for block in _kv_blocks(text):
        if block.get("Chip Name", "").lower() == "mcu":
            mcu = block
        elif "Chip ID" in block or "Health Status" in block:
            chips.append(_chip_detail(block))
            card.update({k: v for k, v in block.items() if k in ("NPU ID", "Chip Count")})
        else:
            card.update(block)
    if len(chips) == 1 and chips[0].power_w is None and "NPU Real-time Power(W)" in mcu:
        # Single-chip cards may report power only in the MCU block; for multi-chip cards it is
        # the card's total and cannot be split per chip.
        chips[0] = structs.replace(chips[0], power_w=num(mcu["NPU Real-time Power(W)"]))
    return NpuDetail(
        npu_id=inum(card.get("NPU ID")),
        chip_count=inum(card.get("Chip Count")),
        fields=card,
        chips=chips,
        mcu=mcu,
    )


# ------------------------------------------------------------------------------ backend ----


class NpuSmiBackend:
    """Ascend NPUs read through the ``npu-smi`` CLI found on PATH.

    ``discover`` runs ``info``, ``info -m`` (logic ids), ``info -t board`` for chips whose
    printed name is anonymised (PCI device id -> catalog model) and ``info -t topo`` (HCCS
    domains); the optional calls may fail without failing discovery. ``sample`` runs only
    ``npu-smi info``.
    """

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
        self._logic: dict[tuple[int, int], int | None] = {}
        self._names: dict[int, str] = {}
        self._domains: dict[int, str] = {}

    @property
    def vendor(self) -> Vendor:
        """``Vendor.ASCEND``."""
        return Vendor.ASCEND

    @property
    def node_id(self) -> str:
        """The node id given at construction."""
        return self._node_id

    def _optional(self, argv: Sequence[str]) -> str | None:
        try:
            return self._run(argv)
        except BackendUnavailable:
            return None

    def _read(self) -> list[DeviceInfo]:
        chips = parse_npu_smi_info(self._run(["npu-smi", "info"]))
        if not chips:
            raise BackendUnavailable("npu-smi info listed no NPUs")
        out: list[DeviceInfo] = []
        for chip in chips:
            key = (chip.card_index or 0, chip.chip_index or 0)
            changes: dict[str, object] = {}
            logic = self._logic.get(key)
            if logic is not None:
                changes["index"] = logic
            if chip.card_index in self._names:
                changes["name"] = self._names[chip.card_index or 0]
            updated = structs.replace(chip, **changes) if changes else chip
            if updated.index in self._domains:
                updated = structs.replace(updated, domain=self._domains[updated.index])
            out.append(updated)
        return out

    def discover(self) -> list[DeviceInfo]:
        """Full discovery (see the class docstring). Raises BackendUnavailable if npu-smi is
        missing or fails."""
        mapping_text = self._optional(["npu-smi", "info", "-m"])
        if mapping_text:
            self._logic = {
                (m.npu_id, m.chip_id): m.logic_id
                for m in parse_npu_smi_mapping(mapping_text)
                if not m.is_mcu and m.logic_id is not None
            }
        chips = self._read()
        for chip in chips:
            npu = chip.card_index
            if npu is None or npu in self._names or self._catalog.lookup(chip.name):
                continue
            board = self._optional(["npu-smi", "info", "-t", "board", "-i", str(npu)])
            pci = parse_npu_smi_detail(board).pci_device_id if board else None
            entry = self._catalog.lookup_pci(Vendor.ASCEND, pci) if pci else None
            if entry is not None:
                self._names[npu] = entry.name
        chips = self._read()
        topo_text = self._optional(["npu-smi", "info", "-t", "topo"])
        if topo_text:
            matrix = parse_topo_matrix(topo_text)
            chips = [
                structs.replace(
                    c,
                    links=matrix.links(f"NPU{c.index}"),
                    cpu_affinity=matrix.cpu_affinity.get(f"NPU{c.index}", ""),
                )
                for c in chips
            ]
            chips = assign_domains(chips, "hccs")
            self._domains = {c.index: c.domain for c in chips if c.domain}
        return chips

    def sample(self) -> list[DeviceSample]:
        """Live readings from ``npu-smi info``."""
        return to_samples(self._read(), self._node_id)

    def close(self) -> None:
        """Nothing to release: every call is a fresh process."""


def merge_detail(info: DeviceInfo, detail: NpuChipDetail) -> DeviceInfo:
    """Overlay a ``-t usages/common/health`` chip reading on a table reading (values the
    detail has win; health takes the worse of both)."""
    health = worst_health(info.health, detail.health or Health.HEALTHY)
    return structs.replace(
        info,
        memory_total_mib=detail.memory_total_mib or info.memory_total_mib,
        memory_used_mib=detail.memory_used_mib
        if detail.memory_used_mib is not None
        else info.memory_used_mib,
        util_pct=detail.util_pct if detail.util_pct is not None else info.util_pct,
        temperature_c=detail.temperature_c
        if detail.temperature_c is not None
        else info.temperature_c,
        power_w=detail.power_w if detail.power_w is not None else info.power_w,
        health=health,
        health_reasons=[*info.health_reasons, *detail.health_reasons],
        ecc=detail.ecc or info.ecc,
    )
