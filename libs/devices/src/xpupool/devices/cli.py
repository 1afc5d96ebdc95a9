"""``xpupool devices``: list the accelerators on this machine (or in saved tool outputs) with
their catalog data. The lead mounts :func:`main` as the ``devices`` subcommand."""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import msgspec

from xpupool.devices.backend import BackendUnavailable, DeviceBackend, DeviceInfo
from xpupool.devices.catalog import Catalog, CatalogError, load_catalog
from xpupool.devices.registry import create_backend
from xpupool.devices.saved import SavedOutput, parse_saved, parse_saved_dir
from xpupool.devices.simulated import SimulatedBackend

__all__ = ["build_parser", "main", "probe_backends"]

BackendFactory = Callable[[str, Catalog], DeviceBackend]


def build_parser(prog: str = "xpupool devices") -> argparse.ArgumentParser:
    """The argument parser (exposed so the root CLI can embed it as a subcommand)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="List accelerators on this machine (NVML, npu-smi, cnmon, rocm-smi/hy-smi) "
        "with model, memory, health and catalog data.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--fixtures",
        type=Path,
        metavar="DIR",
        help="parse every saved tool output under DIR instead of probing this machine",
    )
    parser.add_argument(
        "--from-file",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="parse one saved tool output (repeatable); the tool is told from the content",
    )
    parser.add_argument("--simulate", metavar="PROFILE", help="e.g. 2xA100-80GB,4xAscend910B")
    parser.add_argument("--catalog", type=Path, help="catalog TOML (default: $XPUPOOL_CATALOG)")
    parser.add_argument("--node-id", default=socket.gethostname(), help="node id for device ids")
    return parser


def _factory(name: str) -> BackendFactory:
    return lambda node_id, catalog: create_backend(name, node_id, catalog)


def _tool_backends() -> list[tuple[str, str | None, BackendFactory]]:
    """(label, tool that must be on PATH or None, factory) for every real backend."""
    return [
        ("NVML (libnvidia-ml)", None, _factory("nvml")),
        ("npu-smi", "npu-smi", _factory("npu-smi")),
        ("cnmon", "cnmon", _factory("cnmon")),
        ("rocm-smi", "rocm-smi", _factory("rocm-smi")),
        ("hy-smi", "hy-smi", _factory("hy-smi")),
    ]


def probe_backends(
    node_id: str,
    catalog: Catalog,
    backends: Sequence[tuple[str, str | None, BackendFactory]] | None = None,
) -> tuple[list[tuple[str, list[DeviceInfo]]], list[str]]:
    """Run every backend whose tool is present. Returns ``(found, notes)``: the devices per
    backend label, and one line per backend that was skipped or failed."""
    found: list[tuple[str, list[DeviceInfo]]] = []
    notes: list[str] = []
    for label, tool, factory in backends if backends is not None else _tool_backends():
        if tool is not None and shutil.which(tool) is None:
            notes.append(f"{label}: {tool} not found on PATH")
            continue
        try:
            backend = factory(node_id, catalog)
        except BackendUnavailable as exc:
            notes.append(f"{label}: {exc}")
            continue
        try:
            found.append((label, backend.discover()))
        except BackendUnavailable as exc:
            notes.append(f"{label}: {exc}")
        finally:
            backend.close()
    return found, notes


def _row(source: str, info: DeviceInfo, catalog: Catalog) -> dict[str, Any]:
    entry = catalog.lookup(info.name)
    return {
        "source": source,
        "vendor": info.vendor.value,
        "index": info.index,
        "name": info.name,
        "model": entry.name if entry else None,
        "uuid": info.uuid,
        "pci_bus_id": info.pci_bus_id,
        "memory_total_mib": info.memory_total_mib,
        "memory_used_mib": info.memory_used_mib,
        "util_pct": info.util_pct,
        "temperature_c": info.temperature_c,
        "power_w": info.power_w,
        "health": info.health.value,
        "health_reasons": info.health_reasons,
        "mig_mode": info.mig_mode,
        "partitions": len(info.partitions),
        "domain": info.domain,
        "capacity_units": entry.capacity_units if entry else None,
        "interconnect": entry.interconnect if entry else None,
        "cost_per_hour": entry.cost_per_hour if entry else None,
        "catalog_verified": entry.verified if entry else None,
    }


def _fmt(value: object, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}{suffix}"
    return f"{value}{suffix}"


def _print_table(rows: list[dict[str, Any]], out: TextIO) -> None:
    header = ("VENDOR", "IDX", "MODEL", "MEMORY MiB", "UTIL", "TEMP", "HEALTH", "CAP", "LINK")
    lines = [header]
    for r in rows:
        model = r["model"] or f"{r['name']} (not in catalog)"
        reasons = f" ({'; '.join(r['health_reasons'])})" if r["health_reasons"] else ""
        memory = f"{_fmt(r['memory_used_mib'])}/{_fmt(r['memory_total_mib'])}"
        lines.append(
            (
                r["vendor"],
                str(r["index"]),
                model,
                memory,
                _fmt(r["util_pct"], "%"),
                _fmt(r["temperature_c"], "C"),
                r["health"] + reasons,
                _fmt(r["capacity_units"]),
                r["interconnect"] or "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        out.write("\n")


def _saved_summary(saved: SavedOutput) -> str:
    name = Path(saved.path).name
    if saved.devices:
        return f"{name}: {saved.kind}, {len(saved.devices)} device(s)"
    if saved.mapping:
        chips = [m for m in saved.mapping if not m.is_mcu]
        return f"{name}: {saved.kind}, {len(chips)} chip(s)"
    if saved.detail is not None:
        return f"{name}: {saved.kind}, {len(saved.detail.chips)} chip block(s)"
    if saved.topology is not None:
        return f"{name}: {saved.kind}, {len(saved.topology.devices)} device(s)"
    return f"{name}: {saved.kind}"


def main(argv: list[str] | None = None, *, out: TextIO | None = None) -> int:
    """Run ``xpupool devices``. Returns 0 on success (also when no accelerator is present),
    1 when a saved file could not be parsed, 2 on a bad catalog."""
    stream = out if out is not None else sys.stdout
    args = build_parser().parse_args(argv)
    try:
        catalog = load_catalog(args.catalog)
    except CatalogError as exc:
        stream.write(f"error: {exc}\n")
        return 2
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    failed = False
    if args.fixtures or args.from_file:
        saved: list[SavedOutput] = []
        if args.fixtures:
            if not args.fixtures.is_dir():
                stream.write(f"error: {args.fixtures} is not a directory\n")
                return 1
            saved.extend(parse_saved_dir(args.fixtures, catalog))
        for path in args.from_file:
            try:
                saved.append(parse_saved(path, catalog))
            except (OSError, ValueError) as exc:
                notes.append(f"{path}: cannot parse: {exc}")
                failed = True
        for item in saved:
            notes.append(_saved_summary(item))
            rows.extend(_row(Path(item.path).name, d, catalog) for d in item.devices)
    elif args.simulate:
        sim = SimulatedBackend(args.node_id, args.simulate, catalog)
        rows.extend(_row("simulated", d, catalog) for d in sim.discover())
    else:
        found, notes = probe_backends(args.node_id, catalog)
        for label, devices in found:
            rows.extend(_row(label, d, catalog) for d in devices)
        if not rows:
            if args.json:
                stream.write(msgspec.json.encode({"devices": [], "notes": notes}).decode())
                stream.write("\n")
                return 0
            stream.write("No accelerators found on this machine. Looked for:\n")
            stream.write("".join(f"  - {note}\n" for note in notes))
            return 0
    if args.json:
        stream.write(msgspec.json.encode({"devices": rows, "notes": notes}).decode())
        stream.write("\n")
    else:
        _print_table(rows, stream)
        if notes:
            stream.write("\n" + "".join(f"{note}\n" for note in notes))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
