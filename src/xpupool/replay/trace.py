"""Loading and writing the Alibaba GPU trace v2023 CSV files (openb_*): node lists, and pod lists
with their times (a pod's demand is read as ``xpupool.placement.workload`` reads it)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xpupool.placement.state import NodeSpec, PodDemand
from xpupool.placement.workload import demand_of, number

POD_COLUMNS = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)


@dataclass(frozen=True, slots=True)
class TracePod:
    """One row of a pod list: the demand plus the trace's bookkeeping columns."""

    demand: PodDemand
    creation_time: int = 0
    deletion_time: int = 0
    scheduled_time: int = 0
    qos: str = ""
    phase: str = ""

    @property
    def name(self) -> str:
        """Pod name (unique within a list)."""
        return self.demand.name


def parse_nodes(text: str) -> list[NodeSpec]:
    """Parse an ``openb_node_list_*.csv`` body (``sn,cpu_milli,memory_mib,gpu,model``)."""
    out: list[NodeSpec] = []
    for row in csv.DictReader(io.StringIO(text)):
        model = (row.get("model") or "").strip()
        out.append(
            NodeSpec(
                name=row["sn"],
                cpu_milli=number(row["cpu_milli"]),
                memory_mib=number(row["memory_mib"]),
                num_gpu=number(row.get("gpu")),
                model="" if model.lower() == "nan" else model,
            )
        )
    return out


def parse_pods(text: str) -> list[TracePod]:
    """Parse an ``openb_pod_list_*.csv`` body."""
    out: list[TracePod] = []
    for row in csv.DictReader(io.StringIO(text)):
        out.append(
            TracePod(
                demand=demand_of(row),
                creation_time=number(row.get("creation_time")),
                deletion_time=number(row.get("deletion_time")),
                scheduled_time=number(row.get("scheduled_time")),
                qos=row.get("qos") or "",
                phase=row.get("pod_phase") or "",
            )
        )
    return out


def load_nodes(path: Path) -> list[NodeSpec]:
    """Read a node list CSV file."""
    return parse_nodes(path.read_text(encoding="utf-8"))


def load_pods(path: Path) -> list[TracePod]:
    """Read a pod list CSV file."""
    return parse_pods(path.read_text(encoding="utf-8"))


def format_pods(pods: Iterable[TracePod]) -> str:
    """Serialise pods in the trace's CSV layout (so variants can be replayed like originals)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(POD_COLUMNS)
    for p in pods:
        d = p.demand
        spec = "|".join(sorted(d.allowed_models)) if d.allowed_models else ""
        writer.writerow(
            [
                d.name,
                d.cpu_milli,
                d.memory_mib,
                d.num_gpu,
                d.gpu_milli,
                spec,
                p.qos,
                p.phase,
                p.creation_time,
                p.deletion_time,
                p.scheduled_time,
            ]
        )
    return buf.getvalue()


def find_trace_dir(start: Path, relative: Sequence[str] = ("shared", "traces")) -> Path | None:
    """Walk up from ``start`` looking for ``../shared/traces/alibaba-gpu-v2023`` next to a repo.

    The trace lives beside the repository (``<parent>/shared/traces/...``), so every ancestor's
    parent directory and the ancestor itself are tried.
    """
    for base in [start, *start.parents]:
        for root in (base, base.parent):
            cand = root.joinpath(*relative, "alibaba-gpu-v2023")
            if (cand / "openb_node_list_gpu_node.csv").is_file():
                return cand
    return None
