"""Catalog: data file, aliases, normalised capacity, verification flags, operator overrides."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from xpupool.contracts import Vendor
from xpupool.devices.catalog import (
    CATALOG_ENV,
    Catalog,
    CatalogEntry,
    CatalogError,
    load_catalog,
    normalize_name,
)

REQUIRED_MODELS = [
    "A100-40GB", "A100-80GB", "H100-80GB", "H100 PCIe", "H200", "H20", "L40S", "T4",
    "V100-16GB", "V100-32GB", "Ascend910", "910A", "910B", "910B1", "910B2", "910B3", "910B4",
    "310", "310P3", "MLU370-X4", "MLU370-X8", "RX7800XT", "K100-AI",
]  # fmt: skip

PRINTED_NAMES = {
    "NVIDIA A100-SXM4-40GB": "A100-SXM4-40GB",
    "NVIDIA A100-SXM4-80GB": "A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3": "H100-SXM5-80GB",
    "NVIDIA H100 PCIe": "H100-PCIE-80GB",
    "NVIDIA H20": "H20",
    "Tesla T4": "T4",
    "Tesla V100-SXM2-32GB": "V100-SXM2-32GB",
    "Ascend910B1": "Ascend910B1",
    "910B3": "Ascend910B3",
    "910B2C": "Ascend910B2",
    "Ascend 910A": "Ascend910A",
    "310P3": "Ascend310P3",
    "MLU370-X4": "MLU370-X4",
    "Navi 32 [Radeon RX 7700 XT / 7800 XT]": "RX7800XT",
}

TRACE = Path("traces") / "alibaba-gpu-v2023" / "openb_node_list_gpu_node.csv"


def test_normalize_strips_vendor_prefix_and_punctuation() -> None:
    """Vendor words, case, spaces and dashes do not matter for lookups."""
    assert normalize_name("NVIDIA A100-SXM4-80GB") == "a100sxm480gb"
    assert normalize_name("Ascend 910B1") == normalize_name("Ascend910B1") == "910b1"


@pytest.mark.parametrize("name", REQUIRED_MODELS)
def test_required_model_present(catalog: Catalog, name: str) -> None:
    """Every model the scheduler must know resolves to an entry."""
    assert catalog.lookup(name) is not None


@pytest.mark.parametrize(("printed", "model"), sorted(PRINTED_NAMES.items()))
def test_printed_names_resolve(catalog: Catalog, printed: str, model: str) -> None:
    """Names exactly as vendor tools print them resolve to the right model."""
    entry = catalog.lookup(printed)
    assert entry is not None and entry.name == model


def test_anonymised_name_is_unknown(catalog: Catalog) -> None:
    """Huawei's anonymised 'xxx' never matches a model."""
    assert catalog.lookup("xxx") is None
    assert catalog.lookup("Ascend xxx") is None


def test_pci_id_lookup(catalog: Catalog) -> None:
    """A PCI device id identifies a model whose printed name is anonymised."""
    entry = catalog.lookup_pci(Vendor.ASCEND, "0xD801")
    assert entry is not None and entry.name == "Ascend910"


def test_every_model_has_positive_capacity(catalog: Catalog) -> None:
    """Each entry carries a normalised capacity figure."""
    for entry in catalog:
        assert entry.capacity_units > 0, entry.name


def test_capacity_is_relative_to_a100(catalog: Catalog) -> None:
    """An A100 is 1.0; others scale with dense BF16 (else FP16) TFLOPS."""
    assert catalog.get("A100-80GB").capacity_units == 1.0
    assert catalog.get("H100-80GB").capacity_units == pytest.approx(989.4 / 312, abs=1e-3)
    assert catalog.get("T4").capacity_units == pytest.approx(65 / 312, abs=1e-3)
    assert catalog.get("910B3").capacity_units == pytest.approx(313 / 312, abs=1e-3)


def test_bf16_capability_flags(catalog: Catalog) -> None:
    """T4, V100 and 310P lack BF16; A100 and 910B have it."""
    for name in ("T4", "V100-16GB", "310P3"):
        assert "bf16" not in catalog.get(name).capability_list()
    for name in ("A100-80GB", "910B2"):
        assert "bf16" in catalog.get(name).capability_list()


def test_unverified_figures_flagged(catalog: Catalog) -> None:
    """Second-hand figures are marked: 910B TFLOPS, H100 PCIe TFLOPS; the 910 FP16 is verified."""
    assert not catalog.get("910B3").is_verified("fp16_tflops")
    assert not catalog.get("H100 PCIe").is_verified("fp16_tflops")
    assert catalog.get("Ascend910").is_verified("fp16_tflops")
    assert catalog.get("A100-40GB").verified


def test_unknown_trace_models_marked(catalog: Catalog) -> None:
    """Alibaba's undisclosed G1-G3 are flagged unknown and never count as verified."""
    for name in ("G1", "G2", "G3"):
        entry = catalog.get(name)
        assert entry.unknown and not entry.verified


def test_unverified_lists_name_real_fields(catalog: Catalog) -> None:
    """Every name in 'unverified' is a field of CatalogEntry (no typos)."""
    fields = set(CatalogEntry.__struct_fields__)
    for entry in catalog:
        assert set(entry.unverified) <= fields, entry.name


def test_trace_models_resolve(catalog: Catalog, fixtures_dir: Path) -> None:
    """Every GPU model named in the Alibaba trace's node list is in the catalog."""
    trace = fixtures_dir.parents[1] / TRACE
    if not trace.exists():
        pytest.skip(f"{trace} not present")
    with trace.open() as f:
        models = {row["model"] for row in csv.DictReader(f)}
    assert models and all(catalog.lookup(m) is not None for m in models), models


def test_partition_share(catalog: Catalog) -> None:
    """MIG profiles split by sevenths, vNPU templates by AI cores."""
    assert catalog.get("A100-40GB").partition_share("3g.20gb") == pytest.approx(3 / 7)
    assert catalog.get("910B3").partition_share("vir05_1c_16g") == pytest.approx(5 / 20)
    assert catalog.get("T4").partition_share("bogus") is None


def test_env_override_extends_builtin(tmp_path: Path) -> None:
    """An operator file with extends='builtin' overrides one field and keeps the rest."""
    path = tmp_path / "ops.toml"
    path.write_text(
        '[catalog]\nextends = "builtin"\n\n[[model]]\nname = "T4"\ncost_per_hour = 0.11\n'
    )
    cat = load_catalog(env={CATALOG_ENV: str(path)})
    assert cat.get("T4").cost_per_hour == 0.11
    assert cat.get("T4").fp16_tflops == 65.0
    assert cat.lookup("H100-80GB") is not None


def test_replacing_catalog(tmp_path: Path) -> None:
    """A file without extends replaces the shipped catalog."""
    path = tmp_path / "own.toml"
    path.write_text('[[model]]\nname = "X1"\nvendor = "amd"\nfp16_tflops = 156.0\n')
    cat = load_catalog(path)
    assert len(cat) == 1 and cat.get("X1").capacity_units == 0.5


@pytest.mark.parametrize(
    "body",
    [
        '[[model]]\nname = "X"\nvendor = "intel"\nfp16_tflops = 1.0\n',
        '[[model]]\nname = "X"\nvendor = "amd"\n',
        '[[model]]\nname = "X"\nvendor = "amd"\nfp16_tflops = 1.0\ntypo = 1\n',
        '[[model]]\nname = "X"\nvendor = "amd"\nfp16_tflops = 1\n[[model]]\nname = "Y"\n'
        'vendor = "amd"\nfp16_tflops = 1\naliases = ["x"]\n',
        "not toml [",
    ],
)
def test_bad_catalog_rejected(tmp_path: Path, body: str) -> None:
    """Bad vendors, missing throughput, unknown fields, alias clashes and bad TOML are errors."""
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(CatalogError, match="bad.toml|collides"):
        load_catalog(path)


def test_missing_catalog_file(tmp_path: Path) -> None:
    """A missing operator file is a CatalogError naming the path."""
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog(tmp_path / "absent.toml")
