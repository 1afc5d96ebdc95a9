"""Replay protocol, CLI, dynamic mode and variants on small or reduced traces."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from xpupool.placement.frag import ShapeDistribution
from xpupool.placement.policies import PolicyContext
from xpupool.placement.registry import POLICIES, make_policy
from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand
from xpupool.replay.arrivals import (
    RecordedPolicy,
    build_fgd_workload,
    replay_arrivals,
    replay_dynamic,
)
from xpupool.replay.cli import main, parse_policies, parse_seeds
from xpupool.replay.scheduler_default import decide_arrivals
from xpupool.replay.trace import TracePod, format_pods, parse_pods
from xpupool.replay.variants import VARIANTS, make_variant


def _pods(n: int = 50) -> list[PodDemand]:
    rng = np.random.default_rng(0)
    return [
        PodDemand(1000, 10, int(g), 1000 if g else 0, name=f"p{i:03d}")
        for i, g in enumerate(rng.integers(0, 3, size=n))
    ]


def test_inflation_reaches_ratio_without_exceeding() -> None:
    """The workload is the shuffled list plus draws, stopping before 1.3x capacity is passed."""
    pods = _pods()
    cap = 100_000
    wl = build_fgd_workload(pods, 42, cap)
    total = sum(p.gpu_request_milli for p in wl)
    assert total <= 1.3 * cap
    assert total > 1.3 * cap - max(p.gpu_request_milli for p in pods)
    assert Counter(p.name for p in wl[: len(pods)]) == Counter(p.name for p in pods)


def test_inflation_trims_when_list_exceeds_target() -> None:
    """A list already above the target is cut down by removing random pods."""
    wl = build_fgd_workload(_pods(), 1, 10_000)
    assert sum(p.gpu_request_milli for p in wl) <= 13_000


def test_workload_is_deterministic_per_seed() -> None:
    """Same seed gives the same arrival order; another seed gives another one."""
    pods = _pods()
    a = [p.name for p in build_fgd_workload(pods, 42, 100_000)]
    b = [p.name for p in build_fgd_workload(list(reversed(pods)), 42, 100_000)]
    c = [p.name for p in build_fgd_workload(pods, 43, 100_000)]
    assert a == b and a != c


def test_replay_is_deterministic_and_bins_metrics(small_nodes, small_pods) -> None:
    """Two replays of one seed agree; allocation never exceeds arrival."""
    pods = [p.demand for p in small_pods]
    typ = ShapeDistribution.typical(pods)
    cap = sum(n.num_gpu for n in small_nodes) * 1000
    runs = []
    for _ in range(2):
        wl = build_fgd_workload(pods, 42, cap)
        pol = make_policy("random", PolicyContext(np.random.default_rng(42), pods, typ))
        runs.append(replay_arrivals(small_nodes, wl, pol, typ, seed=42))
    a, b = runs
    assert np.array_equal(a.alloc_by_arrival, b.alloc_by_arrival, equal_nan=True)
    assert a.rejected == b.rejected
    for x in (50, 90, 100):
        assert a.alloc_at(x) <= x + 0.5
    assert 0 < a.frag_at(50) < 100


def test_placements_csv_parses_back_and_revalidates(small_trace, tmp_path: Path) -> None:
    """--placements writes rows that rebuild a valid cluster state, pod by pod."""
    nodes_path, pods_path = small_trace
    out = tmp_path / "placements.csv"
    args = [
        "--nodes",
        str(nodes_path),
        "--pods",
        str(pods_path),
        "--seeds",
        "42",
        "--policy",
        "fgd,xpupool-static",
        "--placements",
        str(out),
        "--jobs",
        "1",
        "--json",
    ]
    with redirect_stdout(io.StringIO()):
        assert main(args) == 0
    demands = {p.name: p.demand for p in parse_pods(pods_path.read_text())}
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert {r["policy"] for r in rows} == {"fgd", "xpupool-static"}
    from xpupool.replay.trace import parse_nodes

    nodes = parse_nodes(nodes_path.read_text())
    for policy in ("fgd", "xpupool-static"):
        state = ClusterState.from_nodes(nodes)
        index = {name: i for i, name in enumerate(state.names)}
        for r in (r for r in rows if r["policy"] == policy):
            pod = demands[r["pod"]]
            gpus = tuple(int(g) for g in r["gpus"].split("-")) if r["gpus"] else ()
            pl = NodeChoice.for_pod(index[r["node"]], gpus, pod)
            assert int(r["gpu_milli"]) == pl.gpu_milli
            assert state.fits(pl, pod)
            state.allocate(pl)


def test_cli_json_on_reduced_trace(small_trace) -> None:
    """The CLI prints the protocol's metrics as JSON for each requested policy."""
    nodes_path, pods_path = small_trace
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(
            [
                "--nodes",
                str(nodes_path),
                "--pods",
                str(pods_path),
                "--seeds",
                "42-43",
                "--policy",
                "bestfit,xpupool-static",
                "--json",
                "--jobs",
                "1",
            ]
        )
    assert rc == 0
    data = json.loads(buf.getvalue())
    assert [p["policy"] for p in data["policies"]] == ["bestfit", "xpupool-static"]
    pol = data["policies"][1]
    assert set(pol["alloc_pct"]) == {"90", "95", "100", "110", "130"}
    assert set(pol["frag_amount_pct"]) == {"50", "80", "100"}
    assert set(pol["rejected_mean"]) == {"cpu", "share", "one", "multi"}
    assert pol["decision_us"]["p99"] > 0 and pol["seeds"] == [42, 43]


def test_cli_text_table_and_bad_input(small_trace, tmp_path: Path) -> None:
    """The default output is a table; a missing file is a clear error with exit code 2."""
    nodes_path, pods_path = small_trace
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(
            [
                "--nodes",
                str(nodes_path),
                "--pods",
                str(pods_path),
                "--seeds",
                "42",
                "--policy",
                "random",
                "--jobs",
                "1",
            ]
        )
    assert rc == 0 and "random" in buf.getvalue() and "@100" in buf.getvalue()
    assert main(["--nodes", str(tmp_path / "none.csv"), "--pods", str(pods_path)]) == 2


def test_parse_seeds() -> None:
    """Seed lists accept ranges and commas."""
    assert parse_seeds("42-44,50") == [42, 43, 44, 50]


def test_dynamic_queue_waits_for_departure() -> None:
    """A pod that does not fit waits in the queue until a departure frees the GPU."""
    nodes = [NodeSpec("n", 8000, 1000, 1, "G")]
    pods = [
        TracePod(PodDemand(1000, 10, 1, 1000, name="a"), creation_time=0, deletion_time=100),
        TracePod(PodDemand(1000, 10, 1, 1000, name="b"), creation_time=10, deletion_time=50),
        TracePod(PodDemand(1000, 10, 0, 0, name="c"), creation_time=20, deletion_time=30),
    ]
    res = replay_dynamic(nodes, pods, make_policy("bestfit"))
    assert res.placed == 3 and res.never_placed == 0
    assert sorted(res.wait_s.tolist()) == [0.0, 0.0, 90.0]
    assert res.util_gpu_pct.max() == 100.0


def test_all_policies_include_the_online_default() -> None:
    """``--policy all`` is every registered policy, the scheduler default's online form too."""
    assert parse_policies("all") == list(POLICIES)
    assert "xpupool-online" in POLICIES


@pytest.mark.parametrize("policy", ["xpupool-static", "xpupool-online"])
def test_dynamic_cli_on_reduced_trace(small_trace, policy: str) -> None:
    """--dynamic reports wait percentiles and utilisation; --plot without matplotlib says so."""
    nodes_path, pods_path = small_trace
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = main(
            [
                "--nodes",
                str(nodes_path),
                "--pods",
                str(pods_path),
                "--dynamic",
                "--policy",
                policy,
                "--json",
            ]
        )
    assert rc == 0
    data = json.loads(buf.getvalue())["policies"][0]
    assert data["placed"] + data["never_placed"] == data["pods"]
    assert data["wait_s"]["p50"] >= 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_shape_the_workload(variant: str, small_nodes, small_pods) -> None:
    """Each variant emphasises its workload type, has unique names and round-trips as CSV."""
    out = make_variant(variant, small_pods, 0, small_nodes)
    names = [p.name for p in out]
    assert len(set(names)) == len(names)
    gpu = [p.demand for p in out if p.demand.num_gpu]
    base_gpu = [p.demand for p in small_pods if p.demand.num_gpu]
    if variant == "sharing-heavy":
        assert sum(p.is_sharing for p in gpu) / len(gpu) > 0.7
    elif variant == "multigpu-heavy":
        multi = sum(p.gpu_request_milli for p in gpu if p.num_gpu > 1)
        assert multi / sum(p.gpu_request_milli for p in gpu) >= 0.45
    elif variant == "cpu-only-heavy":
        cpu = sum(1 for p in out if p.demand.is_cpu_only)
        assert cpu == round(2.5 * sum(1 for p in small_pods if p.demand.is_cpu_only))
        assert len(gpu) == len(base_gpu)
    else:
        constrained = [p for p in gpu if p.allowed_models]
        low, high = (0.2, 0.45) if variant == "gpuspec33" else (0.05, 0.4)
        assert low < len(constrained) / len(gpu) < high
        state = ClusterState.from_nodes(small_nodes)
        for p in constrained:
            assert state.model_mask(p.allowed_models).any()
    assert [p.demand for p in parse_pods(format_pods(out))] == [p.demand for p in out]


def test_policy_default_is_the_scheduler_deciding(small_trace, small_nodes, small_pods) -> None:
    """``--policy default`` scores what the scheduler's own ``decide`` chose, pod by pod, with
    the registry a scheduling cycle builds; ``--live`` refuses it (the live run is the
    scheduler already)."""
    nodes_path, pods_path = small_trace
    args = ["--nodes", str(nodes_path), "--pods", str(pods_path), "--seeds", "42", "--jobs", "1"]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([*args, "--policy", "default", "--json"]) == 0
    (entry,) = json.loads(buf.getvalue())["policies"]
    demands = [p.demand for p in small_pods]
    capacity = sum(n.num_gpu for n in small_nodes) * 1000
    workload = build_fgd_workload(demands, 42, capacity)
    outcomes, _ = decide_arrivals(small_nodes, workload)
    typical = ShapeDistribution.typical(demands)
    direct = replay_arrivals(small_nodes, workload, RecordedPolicy("d", outcomes), typical, seed=42)
    assert entry["policy"] == "default"
    assert entry["alloc_pct"]["100"]["mean"] == pytest.approx(direct.alloc_at(100))
    assert entry["decision_us"]["p50"] > 1  # the scheduler's decide time, not a recording's
    assert main([*args, "--policy", "default", "--live"]) == 2
