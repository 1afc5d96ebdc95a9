"""The real trace and a reduced slice of it, as fixtures for every test folder that replays it
(each folder's conftest imports them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpupool.placement.state import NodeSpec
from xpupool.replay.trace import TracePod, find_trace_dir, load_nodes, load_pods


@pytest.fixture(scope="session")
def trace_dir() -> Path:
    """The Alibaba trace folder beside the repository (skip when absent)."""
    found = find_trace_dir(Path(__file__).resolve().parent)
    if found is None:
        pytest.skip("Alibaba GPU trace not available")
    return found


@pytest.fixture(scope="session")
def small_trace(trace_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A reduced trace: every 10th node and every 10th pod of the real files."""
    out = tmp_path_factory.mktemp("trace")
    node_lines = (trace_dir / "openb_node_list_gpu_node.csv").read_text().splitlines()
    pod_lines = (trace_dir / "openb_pod_list_default.csv").read_text().splitlines()
    nodes = out / "nodes.csv"
    pods = out / "pods.csv"
    nodes.write_text("\n".join([node_lines[0], *node_lines[1::10]]) + "\n")
    pods.write_text("\n".join([pod_lines[0], *pod_lines[1::10]]) + "\n")
    return nodes, pods


@pytest.fixture(scope="session")
def small_nodes(small_trace: tuple[Path, Path]) -> list[NodeSpec]:
    """Nodes of the reduced trace."""
    return load_nodes(small_trace[0])


@pytest.fixture(scope="session")
def small_pods(small_trace: tuple[Path, Path]) -> list[TracePod]:
    """Pods of the reduced trace."""
    return load_pods(small_trace[1])
