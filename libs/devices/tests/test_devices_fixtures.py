"""Every saved vendor-CLI output in shared/fixtures/vendor-cli parses to the hand-checked values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from xpupool.contracts import Health, PartitionSpec, Vendor
from xpupool.devices.backend import to_specs
from xpupool.devices.catalog import Catalog
from xpupool.devices.npu_smi import parse_npu_smi_info
from xpupool.devices.saved import parse_saved


@dataclass(frozen=True)
class Expect:
    """Hand-checked content of one fixture. ``models`` are catalog names (None = not in the
    catalog); ``memory`` is total MiB per device; ``count`` counts devices, non-Mcu chips,
    chip blocks or matrix rows depending on the kind."""

    kind: str
    count: int
    vendor: Vendor | None = None
    models: list[str | None] = field(default_factory=list)
    memory: list[int | None] = field(default_factory=list)
    used: list[int | None] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    health: Health = Health.HEALTHY


A = Vendor.ASCEND
EXPECTED: dict[str, Expect] = {
    "amd/rocm-smi_--json_multi-show-flags__RX7800XT__rocm-6.2.4.json": Expect(
        "rocm-smi-json", 1, Vendor.AMD, ["RX7800XT"], [16368], [11077], [0]
    ),
    "hygon/rocm-smi_--json_multi-show-flags__DCU-K100_AI-class__dtk-24.04.3.json": Expect(
        "rocm-smi-json", 1, Vendor.HYGON, ["K100-AI"], [65520], [2], [0]
    ),
    "cambricon/cnmon__MLU370-X4_x2__cnmon-v5.10.10.txt": Expect(
        "cnmon", 2, Vendor.CAMBRICON, ["MLU370-X4"] * 2, [23308] * 2, [0, 0], [0, 1]
    ),
    "cambricon/cnmon__MLU370-X4_x3__cnmon-v4.20.11_old-layout.txt": Expect(
        "cnmon", 3, Vendor.CAMBRICON, ["MLU370-X4"] * 3, [23308] * 3, [0, 0, 0], [0, 1, 2]
    ),
    "ascend/npu-smi_info__310P3_x1__npu-smi-22.0.2.txt": Expect(
        "npu-smi-info", 1, A, ["Ascend310P3"], [21527], [1807], [0]
    ),
    "ascend/npu-smi_info__310P3_x2_no-version-header.txt": Expect(
        "npu-smi-info", 2, A, ["Ascend310P3"] * 2, [21534] * 2, [1074, 1070], [0, 1]
    ),
    "ascend/npu-smi_info__310_x4-chips__npu-smi-20.2.0.txt": Expect(
        "npu-smi-info", 4, A, ["Ascend310"] * 4, [8192] * 4, [2703] * 4, [0, 1, 2, 3]
    ),
    "ascend/npu-smi_info__310_x4-chips__npu-smi-21.0.4.txt": Expect(
        "npu-smi-info", 4, A, ["Ascend310"] * 4, [8192] * 4, [2703, 2867, 2867, 2867], [3, 4, 5, 6]
    ),
    "ascend/npu-smi_info__910-32GB_x8_anonymized_elided__npu-smi-24.1.rc1.txt": Expect(
        "npu-smi-info", 1, A, [None], [32768], [0], [0]
    ),
    "ascend/npu-smi_info__910A_x4__npu-smi-1.9.3_no-hugepages-column.txt": Expect(
        "npu-smi-info", 4, A, ["Ascend910A"] * 4, [32768] * 4, [0] * 4, [0, 1, 2, 3]
    ),
    "ascend/npu-smi_info__910A_x8__npu-smi-22.0.3.1.txt": Expect(
        "npu-smi-info", 8, A, ["Ascend910A"] * 8, [32768] * 8, [0] * 8, list(range(8))
    ),
    "ascend/npu-smi_info__910B1_x8_elided__npu-smi-23.0.rc2.txt": Expect(
        "npu-smi-info", 3, A, ["Ascend910B1"] * 3, [65536] * 3, [4175, 4175, 4174], [0, 1, 2]
    ),
    "ascend/npu-smi_info__910B2C_x2__npu-smi-23.0.3.txt": Expect(
        "npu-smi-info", 2, A, ["Ascend910B2"] * 2, [65536] * 2, [3317, 3316], [0, 1]
    ),
    "ascend/npu-smi_info_-m__310P-duo_x4-cards_2-chips-each.txt": Expect("npu-smi-mapping", 8, A),
    "ascend/npu-smi_info_-m__310_x4-chips_with-mcu.txt": Expect("npu-smi-mapping", 4, A),
    "ascend/npu-smi_info_-m__910A_x8.txt": Expect("npu-smi-mapping", 8, A),
    "ascend/npu-smi_info_-m__910B-class_x8_with-mcu.txt": Expect("npu-smi-mapping", 8, A),
    "ascend/npu-smi_info_-t_board_-c__310P-class.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_board_-c__910B-class.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_board_-i_0_-c_0__910-32GB.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_board_-i_0__910-32GB.txt": Expect("npu-smi-detail", 0, A),
    "ascend/npu-smi_info_-t_common_-i_1__910B1.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_common__310P-duo_2chips.txt": Expect("npu-smi-detail", 2, A),
    "ascend/npu-smi_info_-t_common__910B-class_1chip.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_ecc_-i_1__910-32GB.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_health_-i_0_-c_0__910-32GB.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_usages_-i_0__910-32GB.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_usages__310P-duo_2chips.txt": Expect("npu-smi-detail", 2, A),
    "ascend/npu-smi_info_-t_usages__910-32GB_1chip.txt": Expect("npu-smi-detail", 1, A),
    "ascend/npu-smi_info_-t_topo__910B1_x8.txt": Expect("npu-smi-topo", 8, A),
    "ascend/npu-smi_info_-t_topo__910B3_x8.txt": Expect("npu-smi-topo", 8, A),
    "ascend/npu-smi_info_-h__npu-smi-23.0.rc2.txt": Expect("npu-smi-help", 0, A),
    "nvidia/nvidia-smi_-q_-x__A100-SXM4-40GB_MIG-enabled__driver-510.47.03.xml": Expect(
        "nvidia-smi-xml", 1, Vendor.NVIDIA, ["A100-SXM4-40GB"], [40960], [38], [0]
    ),
    "nvidia/nvidia-smi__H20_x8_elided__driver-535.161.03.txt": Expect(
        "nvidia-smi", 3, Vendor.NVIDIA, ["H20"] * 3, [97871] * 3, [0] * 3, [0, 1, 7]
    ),
    "nvidia/nvidia-smi_topo_-m__H20_x8_NV18.txt": Expect("nvidia-smi-topo", 8, Vendor.NVIDIA),
}


def _count(saved_kind: str, path: Path, catalog: Catalog) -> int:
    saved = parse_saved(path, catalog)
    if saved.devices:
        return len(saved.devices)
    if saved.mapping:
        return len([m for m in saved.mapping if not m.is_mcu])
    if saved.detail is not None:
        return len(saved.detail.chips)
    if saved.topology is not None:
        return len(saved.topology.devices)
    return 0


def test_fixture_parses(fixture_file: Path | None, fixtures_dir: Path, catalog: Catalog) -> None:
    """Each fixture file is recognised, parses, and matches its hand-checked expectations."""
    assert fixture_file is not None
    rel = str(fixture_file.relative_to(fixtures_dir))
    saved = parse_saved(fixture_file, catalog)
    assert saved.kind != "unknown", f"{rel}: no parser recognises this output"
    expect = EXPECTED.get(rel)
    if expect is None:
        pytest.fail(f"{rel} parsed as {saved.kind}; hand-check it and add it to EXPECTED")
    assert saved.kind == expect.kind
    assert saved.vendor == expect.vendor
    assert _count(saved.kind, fixture_file, catalog) == expect.count
    if not expect.models:
        return
    devices = saved.devices
    found = [catalog.lookup(d.name) for d in devices]
    assert [e.name if e else None for e in found] == expect.models
    assert [d.memory_total_mib for d in devices] == expect.memory
    assert [d.memory_used_mib for d in devices] == expect.used
    assert [d.index for d in devices] == expect.indices
    assert {d.health for d in devices} == {expect.health}
    assert {d.vendor for d in devices} == {expect.vendor}


def test_expectations_name_existing_files(fixtures_dir: Path) -> None:
    """The table names no fixture that has gone away."""
    missing = [rel for rel in EXPECTED if not (fixtures_dir / rel).is_file()]
    assert not missing


def read(fixtures_dir: Path, rel: str) -> str:
    return (fixtures_dir / rel).read_text()


def test_npu_table_details(fixtures_dir: Path) -> None:
    """NA power is None, the 310P3's large NPU id is kept as card id, versions are read."""
    text = read(fixtures_dir, "ascend/npu-smi_info__310P3_x1__npu-smi-22.0.2.txt")
    (chip,) = parse_npu_smi_info(text)
    assert chip.power_w is None and chip.temperature_c == 47.0
    assert chip.card_index == 2144 and chip.chip_index == 0 and chip.driver_version == "22.0.4"
    assert chip.pci_bus_id == "0000:86:00.0"


def test_npu_warning_health(fixtures_dir: Path) -> None:
    """A Warning health (no fixture shows one) degrades the chip and names the reason."""
    text = read(fixtures_dir, "ascend/npu-smi_info__910B2C_x2__npu-smi-23.0.3.txt")
    first, second = parse_npu_smi_info(text.replace("| OK  ", "| Warning", 1))
    assert first.health is Health.DEGRADED and first.health_reasons == ["health Warning"]
    assert second.health is Health.HEALTHY


def test_npu_process_rows(fixtures_dir: Path) -> None:
    """Process rows attach to their (NPU, chip); 'No running processes' rows are skipped."""
    text = read(fixtures_dir, "ascend/npu-smi_info__910B2C_x2__npu-smi-23.0.3.txt")
    assert all(not c.processes for c in parse_npu_smi_info(text))
    with_proc = text.replace(
        "| No running processes found in NPU 1                                        "
        "                    |",
        "| 1       0                 | 4242          | python                   | 2048    |",
    )
    chips = parse_npu_smi_info(with_proc)
    assert chips[1].processes[0].pid == 4242 and chips[1].processes[0].memory_used_mib == 2048


def test_npu_detail_values(fixtures_dir: Path, catalog: Catalog) -> None:
    """usages give used = capacity x rate; common gives power; board gives the PCI id."""
    duo = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_usages__310P-duo_2chips.txt").detail
    assert duo is not None and duo.chip_count == 2
    assert [(c.chip_id, c.memory_total_mib, c.memory_used_mib) for c in duo.chips] == [
        (0, 44280, 1328),
        (1, 43693, 1311),
    ]
    common = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_common_-i_1__910B1.txt").detail
    assert common is not None
    assert (common.chips[0].power_w, common.chips[0].aicore_count) == (93.4, 24)
    board = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_board_-i_0__910-32GB.txt").detail
    assert board is not None and board.pci_device_id == "0xD801"
    entry = catalog.lookup_pci(Vendor.ASCEND, board.pci_device_id)
    assert entry is not None and entry.name == "Ascend910"
    health = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_health_-i_0_-c_0__910-32GB.txt")
    assert health.detail is not None and health.detail.chips[0].health is Health.HEALTHY
    ecc = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_ecc_-i_1__910-32GB.txt").detail
    assert ecc is not None and ecc.chips[0].ecc is not None
    assert ecc.chips[0].ecc.aggregate_uncorrected == 0


def test_npu_mapping_skips_mcu(fixtures_dir: Path) -> None:
    """Mcu rows have no logic id; a 310P Duo has two chips per NPU id."""
    saved = parse_saved(fixtures_dir / "ascend/npu-smi_info_-m__310P-duo_x4-cards_2-chips-each.txt")
    chips = [(m.npu_id, m.chip_id, m.logic_id) for m in saved.mapping if not m.is_mcu]
    assert chips[:3] == [(1, 0, 0), (1, 1, 1), (2, 0, 2)]
    assert sum(m.is_mcu for m in saved.mapping) == 4


def test_topology_matrices(fixtures_dir: Path) -> None:
    """topo -m gives NV18 NVLinks and NUMA affinity; npu-smi topo gives an HCCS full mesh."""
    nv = parse_saved(fixtures_dir / "nvidia/nvidia-smi_topo_-m__H20_x8_NV18.txt").topology
    assert nv is not None
    links = nv.links("GPU0")
    assert len(links) == 7 and {(link.kind, link.lanes) for link in links} == {("nvlink", 18)}
    assert nv.numa_affinity["GPU7"] == "1" and nv.cpu_affinity["GPU0"] == "0-95,192-287"
    hccs = parse_saved(fixtures_dir / "ascend/npu-smi_info_-t_topo__910B3_x8.txt").topology
    assert hccs is not None and {link.kind for link in hccs.links("NPU5")} == {"hccs"}


def test_a100_mig_xml_to_specs(fixtures_dir: Path, catalog: Catalog) -> None:
    """A MIG-enabled A100 yields one spec per MIG device, profile inferred from memory."""
    saved = parse_saved(
        fixtures_dir / "nvidia/nvidia-smi_-q_-x__A100-SXM4-40GB_MIG-enabled__driver-510.47.03.xml"
    )
    (gpu,) = saved.devices
    assert gpu.mig_mode is True and gpu.util_pct is None and gpu.power_limit_w == 400.0
    assert gpu.ecc is not None and gpu.ecc.volatile_corrected is None
    assert gpu.ecc.aggregate_uncorrected == 0 and gpu.memory_temperature_c == 44.0
    specs = to_specs(saved.devices, "n1", catalog)
    assert [s.device_id for s in specs] == ["n1/nvidia0/mig1.0", "n1/nvidia0/mig2.0"]
    assert all(s.parent_uuid == gpu.uuid and s.memory_mib == 19968 for s in specs)
    assert specs[0].capacity_units == pytest.approx(3 / 7, abs=1e-3)
    # The XML names no profile: the catalog's nearest one gives the cut and its slices.
    assert [s.partition for s in specs] == [
        PartitionSpec(
            kind="mig",
            profile="3g.20gb",
            gpu_slices=3,
            compute_slices=3,
            slices_total=7,
            gpu_instance_id=gi,
            compute_instance_id=0,
        )
        for gi in (1, 2)
    ]


def test_h20_table_values(fixtures_dir: Path) -> None:
    """The 535 table gives power draw and cap, temperature, MIG mode and ECC."""
    saved = parse_saved(fixtures_dir / "nvidia/nvidia-smi__H20_x8_elided__driver-535.161.03.txt")
    gpu = saved.devices[0]
    assert (gpu.power_w, gpu.power_limit_w, gpu.temperature_c) == (72.0, 500.0, 24.0)
    assert gpu.mig_mode is False and gpu.pci_bus_id == "00000000:04:00.0"
    assert gpu.driver_version == "535.161.03"


def test_cnmon_values(fixtures_dir: Path) -> None:
    """cnmon v5 gives bus ids and the power cap; v4 gives the driver from its Driver column."""
    v5 = parse_saved(fixtures_dir / "cambricon/cnmon__MLU370-X4_x2__cnmon-v5.10.10.txt").devices
    assert (v5[1].pci_bus_id, v5[1].power_w, v5[1].power_limit_w) == ("0000:36:00.0", 27.0, 150.0)
    v4 = parse_saved(
        fixtures_dir / "cambricon/cnmon__MLU370-X4_x3__cnmon-v4.20.11_old-layout.txt"
    ).devices
    assert v4[2].temperature_c == 30.0 and v4[0].driver_version == "4.20.11"


def test_cnmon_ecc_degrades(fixtures_dir: Path) -> None:
    """A non-zero Ecc-Error count degrades the MLU."""
    text = (fixtures_dir / "cambricon/cnmon__MLU370-X4_x2__cnmon-v5.10.10.txt").read_text()
    from xpupool.devices.cnmon import parse_cnmon

    devices = parse_cnmon(text.replace("0%                N/A |", "0%                  3 |", 1))
    assert devices[0].health is Health.DEGRADED and devices[1].health is Health.HEALTHY
