"""The end-to-end benchmarks still run: a very short ``bench_e2e.py --quick`` and ``anatomy.py``
on a few jobs, on their own servers. The figures are not checked (speed is measured by the
benchmarks, never asserted); that they come out, with every job's outcome counted and the
audit clean, is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xpupool.replay.trace import find_trace_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "bench" / "e2e"


def test_bench_quick_runs_clean_with_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [
        sys.executable, str(BENCH / "bench_e2e.py"), "--quick", "--out", str(out),
        "--duration-s", "2", "--open-s", "1", "--serial-count", "16", "--floor-serial-count", "20",
        "--floor-s", "0.5",
        "--serial-costs", "--latencies", str(tmp_path / "latencies"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(out.read_text())["results"]
    assert result["problems"] == []
    # Each open phase's jobs, one by one, for bench/e2e/timeline.py.
    for percent in (25, 50, 80):
        name = f"{result['scenario']}-open-{percent}.json"
        phase = json.loads((tmp_path / "latencies" / name).read_text())
        assert len(phase["granted"]) == result["open"][f"{percent}%"]["granted"]
        assert all(latency > 0 for _, latency in phase["granted"])
        # Redis's latency monitor, per kind: (second, slowest ms) samples of 1 ms and more.
        events = phase["redis_latency_events"]
        assert all(ms >= 1 for samples in events.values() for _, ms in samples)
    timeline = subprocess.run(
        [sys.executable, str(BENCH / "timeline.py"), str(tmp_path / "latencies")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert timeline.returncode == 0 and "-open-50" in timeline.stdout, timeline.stderr
    closed = result["closed"]
    assert closed["grants"] > 0 and closed["ratio_to_floor"] > 0
    # The floor took turns with the closed loop, one slice each per round.
    assert len(result["floor"]["rate_per_s_by_round"]) == len(closed["grants_per_s_by_round"]) == 4
    assert result["floor"]["serial_p50_ms"] > 0
    assert closed["redis_commands_per_grant_by_name"]
    assert closed["cycles"] >= 0  # read from the scheduler's metrics
    assert closed["cycle_ms_mean"] >= 0
    assert closed["load_generator_full_collections"] >= 0
    assert {"scheduler-1", "lease-manager-0"} <= set(closed["cpu_s_per_1000_grants"])
    assert set(result["open"]) == {"serial", "25%", "50%", "80%"}
    serial = result["open"]["serial"]
    assert 0 <= serial["view_changed"] <= serial["decided_on_kept_copy"] <= serial["granted"]
    assert serial["cpu_ms_per_job"]["scheduler-1"] > 0
    # Socket sends are write system calls: every grant makes the scheduler write some.
    assert serial["syscalls_per_job"]["scheduler-1"]["write"] > 0
    assert closed["syscalls_per_grant"]["lease-manager-0"]["write"] > 0
    assert serial["redis_us_per_job"]["script pend"]["calls"] >= 1
    for rate in ("25%", "50%", "80%"):
        level = result["open"][rate]
        # What each open-loop rate cost, per job and in cores, and what it was placed on.
        assert level["cores_busy"] > 0
        assert {"scheduler-1", "lease-manager-0"} <= set(level["cpu_ms_per_job"])
        assert 0 <= level["view_changed"] <= level["decided_on_kept_copy"] <= level["granted"]
        assert 0 <= level["decided_on_carried_read"] <= level["granted"]
        assert level["aof_rewrites"] >= 0
        assert 0 <= level["jobs_during_aof_rewrites"] <= level["granted"]
        assert level["aof_rewrite_s"] >= 0
        # The load generator's own collector, kept out of the measured slices.
        assert level["load_generator_full_collections"] >= 0


@pytest.mark.skipif(
    find_trace_dir(BENCH) is None, reason="the Alibaba trace is not beside the repository"
)
def test_bench_on_the_trace_runs_clean(tmp_path: Path) -> None:
    """``--workload trace``: the trace's 1,213 GPU nodes register (6,212 devices) and its pods,
    as requests, each get exactly one outcome."""
    out = tmp_path / "bench.json"
    command = [
        sys.executable, str(BENCH / "bench_e2e.py"), "--workload", "trace", "--quick",
        "--out", str(out), "--duration-s", "2", "--open-s", "1", "--serial-count", "8",
        "--floor-serial-count", "20", "--floor-s", "0.5",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    [result] = json.loads(out.read_text())["results"]
    assert result["workload"] == "trace" and result["problems"] == []
    assert result["devices_registered"] == result["devices"] == 6212
    assert result["closed"]["grants"] > 0
    assert sum(result["outcomes"].values()) == result["submitted"]


def test_anatomy_times_the_steps_of_a_job() -> None:
    command = [sys.executable, str(BENCH / "anatomy.py"), "--jobs", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "submit -> grant as the client saw it" in done.stdout
    # A job that fits is decided and granted as it is admitted (no scheduling cycle).
    for step in (
        "process xpupool.tenant.v1.{tenant}.jobs.submit",
        "schedule admission",
        "schedule decision",
        "publish granted",
    ):
        assert step in done.stdout, done.stdout


def test_script_costs_times_the_ledger_scripts_and_their_parts() -> None:
    command = [sys.executable, str(BENCH / "script_costs.py"), "--nodes", "4", "--jobs", "20"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("pend.lua", "end.lua", "AOF per admission + release", "4 cjson encode+decode"):
        assert line in done.stdout, done.stdout
    # A collector's tick, by the shape of its samples.
    for shape in ("busy", "busy, memory held", "idle, 0 MiB", "idle, Ascend HBM"):
        assert f"tick, {shape} " in done.stdout, done.stdout


def test_script_costs_compares_with_a_baseline_on_one_server() -> None:
    """``--baseline-lua``: each admission, release and tick also runs on a ledger whose scripts
    are the baseline's, and every figure is given beside the baseline's. Against the same
    scripts, a tick writes about the same AOF bytes on both (the namespaces are of one length;
    the integrals' digits vary with the clock)."""
    lua = ROOT / "libs/ledger/src/xpupool/ledger/lua"
    command = [sys.executable, str(BENCH / "script_costs.py"), "--nodes", "4", "--jobs", "20"]
    done = subprocess.run(
        [*command, "--baseline-lua", str(lua)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("pend.lua", "end.lua"):
        assert any(
            line.startswith(name) and "the baseline's" in line for line in done.stdout.splitlines()
        ), done.stdout
    for shape in ("busy", "busy, memory held", "idle, 0 MiB", "idle, Ascend HBM"):
        [line] = [x for x in done.stdout.splitlines() if x.startswith(f"tick, {shape} ")]
        mine = float(line.split("us in Redis,")[1].split("bytes of AOF")[0])
        theirs = float(line.split("interleaved), ")[1].split(" bytes")[0])
        assert abs(mine - theirs) <= 0.05 * theirs, line


def test_script_costs_names_records_as_production_does_when_asked() -> None:
    """``--production-ids``: UUID ids, long node names and slice metadata make every record
    larger than the short ids do, and the figures are reported the same way."""

    def kept(*flags: str) -> dict[str, float]:
        command = [sys.executable, str(BENCH / "script_costs.py"), "--nodes", "4", "--jobs", "20"]
        done = subprocess.run(
            [*command, *flags], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return {
            line[:30].strip(): float(line[30:].split()[0])
            for line in done.stdout.splitlines()
            if line.startswith(("memory per", "AOF per"))
        }

    short, production = kept(), kept("--production-ids")
    assert (
        set(short)
        == set(production)
        == {
            "AOF per admission + release",
            "memory per ended lease",
            "memory per ended job",
            "memory per usage record",
        }
    )
    assert all(production[name] > short[name] for name in short)
