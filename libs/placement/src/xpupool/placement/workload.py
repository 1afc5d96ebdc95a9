"""Workload files: the pod shapes a cluster expects, for the policies that are told them.

FGD and ``xpupool`` measure fragmentation against the shapes the cluster will see. Told rather
than learned (``placement_workload`` in the scheduler's settings, the replay's original list),
those shapes come in the pod-list CSV layout of the Alibaba GPU trace v2023: one row per pod
with ``cpu_milli``, ``memory_mib``, ``num_gpu``, ``gpu_milli`` and ``gpu_spec`` (models joined
by ``|``); other columns (the trace's times, QoS, phase) are ignored here.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path

from xpupool.placement.state import PodDemand

__all__ = ["demand_of", "load_demands", "number", "parse_demands"]


def number(value: str | None, default: int = 0) -> int:
    """A CSV cell as an integer (``nan`` and empty cells are ``default``)."""
    if value is None or value.strip() in ("", "nan", "NaN"):
        return default
    return int(float(value))


def _models(spec: str | None) -> frozenset[str] | None:
    if spec is None:
        return None
    parts = [p for p in spec.strip().split("|") if p and p.lower() != "nan"]
    return frozenset(parts) if parts else None


def demand_of(row: Mapping[str, str]) -> PodDemand:
    """The demand of one pod-list row."""
    num_gpu = number(row.get("num_gpu"))
    return PodDemand(
        cpu_milli=number(row["cpu_milli"]),
        memory_mib=number(row["memory_mib"]),
        num_gpu=num_gpu,
        gpu_milli=number(row.get("gpu_milli")) if num_gpu else 0,
        allowed_models=_models(row.get("gpu_spec")) if num_gpu else None,
        name=row["name"],
    )


def parse_demands(text: str) -> list[PodDemand]:
    """The demands of a pod-list CSV body."""
    return [demand_of(row) for row in csv.DictReader(io.StringIO(text))]


def load_demands(path: Path) -> list[PodDemand]:
    """The demands of a pod-list CSV file."""
    return parse_demands(path.read_text(encoding="utf-8"))
