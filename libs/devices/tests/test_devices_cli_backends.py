"""CLI backends driven by a fake runner, the tool runner's error handling, and `xpupool devices`."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from xpupool.contracts import Health, Vendor
from xpupool.devices._tools import run_tool
from xpupool.devices.backend import BackendUnavailable, DeviceBackend, to_specs
from xpupool.devices.catalog import Catalog
from xpupool.devices.cli import main, probe_backends
from xpupool.devices.cnmon import CnmonBackend
from xpupool.devices.npu_smi import NpuSmiBackend
from xpupool.devices.rocm_smi import RocmSmiBackend


class FakeRunner:
    """Answers argv with fixture text; anything unknown fails like a real tool would."""

    def __init__(self, answers: dict[tuple[str, ...], str]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str]) -> str:
        key = tuple(argv)
        self.calls.append(key)
        if key not in self.answers:
            raise BackendUnavailable(f"{' '.join(argv)} exited with status 255: not supported")
        return self.answers[key]


def text(fixtures_dir: Path, rel: str) -> str:
    return (fixtures_dir / rel).read_text()


def test_npu_backend_uses_mapping_and_topology(fixtures_dir: Path, catalog: Catalog) -> None:
    """npu-smi discovery takes logic ids from -m and HCCS domains from -t topo."""
    runner = FakeRunner(
        {
            ("npu-smi", "info"): text(
                fixtures_dir, "ascend/npu-smi_info__910A_x8__npu-smi-22.0.3.1.txt"
            ),
            ("npu-smi", "info", "-m"): text(fixtures_dir, "ascend/npu-smi_info_-m__910A_x8.txt"),
            ("npu-smi", "info", "-t", "topo"): text(
                fixtures_dir, "ascend/npu-smi_info_-t_topo__910B1_x8.txt"
            ),
        }
    )
    backend = NpuSmiBackend("n1", catalog, runner=runner)
    assert isinstance(backend, DeviceBackend)
    infos = backend.discover()
    assert [i.index for i in infos] == list(range(8))
    assert {i.domain for i in infos} == {"hccs0"} and infos[0].cpu_affinity == "144-167"
    specs = to_specs(infos, "n1", catalog)
    assert specs[3].device_id == "n1/ascend3" and specs[3].domain == "n1/hccs0"
    samples = backend.sample()
    assert len(samples) == 8 and samples[3].power_w == 191.7


def test_npu_backend_resolves_anonymised_name(fixtures_dir: Path, catalog: Catalog) -> None:
    """An 'xxx' chip is identified through -t board's PCI device id (0xD801 = Ascend 910)."""
    runner = FakeRunner(
        {
            ("npu-smi", "info"): text(
                fixtures_dir,
                "ascend/npu-smi_info__910-32GB_x8_anonymized_elided__npu-smi-24.1.rc1.txt",
            ),
            ("npu-smi", "info", "-t", "board", "-i", "7"): text(
                fixtures_dir, "ascend/npu-smi_info_-t_board_-i_0__910-32GB.txt"
            ),
        }
    )
    (info,) = NpuSmiBackend("n1", catalog, runner=runner).discover()
    assert info.name == "Ascend910" and to_specs([info], "n1", catalog)[0].model == "Ascend910"


def test_npu_backend_missing_tool(catalog: Catalog) -> None:
    """A missing npu-smi surfaces as BackendUnavailable naming the tool."""
    with pytest.raises(BackendUnavailable, match="npu-smi"):
        NpuSmiBackend("n1", catalog, runner=FakeRunner({})).discover()


def test_cnmon_backend(fixtures_dir: Path, catalog: Catalog) -> None:
    """cnmon discovery yields MLU370-X4 specs with catalog capacity."""
    runner = FakeRunner(
        {("cnmon",): text(fixtures_dir, "cambricon/cnmon__MLU370-X4_x2__cnmon-v5.10.10.txt")}
    )
    specs = to_specs(CnmonBackend("n1", catalog, runner=runner).discover(), "n1", catalog)
    assert [s.device_id for s in specs] == ["n1/cambricon0", "n1/cambricon1"]
    assert specs[0].model == "MLU370-X4" and specs[0].memory_mib == 23308


def test_rocm_backend_hygon(fixtures_dir: Path, catalog: Catalog) -> None:
    """hy-smi output with an anonymised card series resolves to the K100-AI by PCI id."""
    from xpupool.devices.rocm_smi import ROCM_SMI_ARGS

    json_text = text(
        fixtures_dir, "hygon/rocm-smi_--json_multi-show-flags__DCU-K100_AI-class__dtk-24.04.3.json"
    )
    runner = FakeRunner({("hy-smi", *ROCM_SMI_ARGS): json_text})
    backend = RocmSmiBackend("n1", catalog, vendor=Vendor.HYGON, tool="hy-smi", runner=runner)
    (sample,) = backend.sample()
    assert sample.device_id == "n1/hygon0" and sample.memory_used_mib == 2
    assert sample.health is Health.HEALTHY


def test_rocm_backend_bad_json(catalog: Catalog) -> None:
    """Unreadable JSON is reported as BackendUnavailable."""
    from xpupool.devices.rocm_smi import ROCM_SMI_ARGS

    runner = FakeRunner({("rocm-smi", *ROCM_SMI_ARGS): "WARNING: no driver"})
    with pytest.raises(BackendUnavailable, match="unreadable JSON"):
        RocmSmiBackend("n1", catalog, runner=runner).discover()


def test_run_tool_missing() -> None:
    """A tool not on PATH raises BackendUnavailable with the stock message."""
    with pytest.raises(BackendUnavailable, match="npu-smi-does-not-exist not found on PATH"):
        run_tool(["npu-smi-does-not-exist", "info"])


def test_run_tool_failure_and_timeout() -> None:
    """A non-zero exit and a timeout both become BackendUnavailable."""
    with pytest.raises(BackendUnavailable, match="status 3: boom"):
        run_tool([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    with pytest.raises(BackendUnavailable, match="timed out"):
        run_tool([sys.executable, "-c", "import time; time.sleep(5)"], timeout_s=0.2)


def test_probe_reports_missing_tools(catalog: Catalog) -> None:
    """Probing with no tools present returns no devices and one note per backend."""

    def unavailable(node: str, cat: Catalog) -> DeviceBackend:
        raise BackendUnavailable("NVML unavailable: NVML Shared Library Not Found")

    found, notes = probe_backends(
        "n1", catalog, [("NVML", None, unavailable), ("cnmon", "cnmon-absent-tool", unavailable)]
    )
    assert found == []
    assert notes == [
        "NVML: NVML unavailable: NVML Shared Library Not Found",
        "cnmon: cnmon-absent-tool not found on PATH",
    ]


def test_cli_on_machine_without_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without accelerators the CLI says what it looked for and exits 0."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("XPUPOOL_CATALOG", raising=False)
    out = io.StringIO()
    assert main([], out=out) == 0
    report = out.getvalue()
    if "No accelerators found" not in report:
        pytest.skip("this machine has an NVIDIA GPU")
    for tool in ("NVML", "npu-smi", "cnmon", "rocm-smi", "hy-smi"):
        assert tool in report


def test_cli_fixtures_table(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--fixtures lists every parsed device with its catalog model."""
    monkeypatch.delenv("XPUPOOL_CATALOG", raising=False)
    out = io.StringIO()
    assert main(["--fixtures", str(fixtures_dir)], out=out) == 0
    report = out.getvalue()
    for model in ("Ascend910B1", "MLU370-X4", "K100-AI", "H20", "A100-SXM4-40GB", "RX7800XT"):
        assert model in report
    assert "xxx (not in catalog)" in report


def test_cli_json_from_file(fixtures_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--from-file --json prints machine-readable rows with catalog data."""
    monkeypatch.delenv("XPUPOOL_CATALOG", raising=False)
    out = io.StringIO()
    path = fixtures_dir / "ascend/npu-smi_info__910B2C_x2__npu-smi-23.0.3.txt"
    assert main(["--json", "--from-file", str(path)], out=out) == 0
    rows = json.loads(out.getvalue())["devices"]
    assert [(r["model"], r["memory_total_mib"], r["health"]) for r in rows] == [
        ("Ascend910B2", 65536, "healthy")
    ] * 2


def test_cli_bad_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable saved file is reported and the exit code is 1."""
    monkeypatch.delenv("XPUPOOL_CATALOG", raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = io.StringIO()
    assert main(["--from-file", str(bad)], out=out) == 1
    assert "cannot parse" in out.getvalue()


def test_cli_simulate(monkeypatch: pytest.MonkeyPatch) -> None:
    """--simulate shows the simulated devices."""
    monkeypatch.delenv("XPUPOOL_CATALOG", raising=False)
    out = io.StringIO()
    assert main(["--simulate", "2xH20", "--node-id", "n1"], out=out) == 0
    assert out.getvalue().count("H20") == 2


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("npu-smi", NpuSmiBackend),
        ("ascend", NpuSmiBackend),
        ("cnmon", CnmonBackend),
        ("rocm-smi", RocmSmiBackend),
        ("hygon", RocmSmiBackend),
    ],
)
def test_registry_builds_backends(catalog: Catalog, name: str, kind: type) -> None:
    """Backends are built by configured name or vendor alias."""
    from xpupool.devices.registry import create_backend

    backend = create_backend(name, "n1", catalog)
    assert isinstance(backend, kind) and backend.node_id == "n1"


def test_registry_rejects_unknown_and_bare_simulated(catalog: Catalog) -> None:
    """Unknown names and a simulated backend without a profile are errors; with one it works."""
    from xpupool.devices.registry import create_backend

    with pytest.raises(ValueError, match="unknown device backend"):
        create_backend("tpu", "n1", catalog)
    with pytest.raises(ValueError, match="profile"):
        create_backend("simulated", "n1", catalog)
    assert len(create_backend("simulated", "n1", catalog, profile="2xT4").discover()) == 2
