"""Outputs recorded on a real NVIDIA H200 (``data/nvidia/SOURCES.md``) parse to what the GPU
reported through NVML in the same session."""

from __future__ import annotations

from pathlib import Path

from xpupool.contracts import Health, Vendor
from xpupool.devices.backend import to_specs
from xpupool.devices.catalog import load_catalog
from xpupool.devices.saved import parse_saved

DATA = Path(__file__).parent / "data" / "nvidia"
UUID = "GPU-e351beea-08da-1995-c5cd-a7acc0a16b3f"


def test_the_xml_and_the_table_read_as_nvml_did() -> None:
    xml = parse_saved(DATA / "nvidia-smi_-q_-x__H200__driver-580.159.04.xml")
    table = parse_saved(DATA / "nvidia-smi__H200__driver-580.159.04.txt")
    assert (xml.kind, table.kind) == ("nvidia-smi-xml", "nvidia-smi")
    for saved in (xml, table):
        (gpu,) = saved.devices
        assert gpu.vendor is Vendor.NVIDIA and gpu.name == "NVIDIA H200"
        assert gpu.memory_total_mib == 143_771
        assert gpu.pci_bus_id == "00000000:00:06.0" and gpu.driver_version == "580.159.04"
        assert gpu.mig_mode is False and gpu.partitions == [] and gpu.health is Health.HEALTHY
    assert xml.devices[0].uuid == UUID


def test_the_catalog_knows_it() -> None:
    (gpu,) = parse_saved(DATA / "nvidia-smi_-q_-x__H200__driver-580.159.04.xml").devices
    catalog = load_catalog(None)
    entry = catalog.lookup(gpu.name)
    assert entry is not None and entry.name == "H200-SXM-141GB"
    (spec,) = to_specs([gpu], "n1", catalog)
    assert spec.model == "H200-SXM-141GB" and spec.memory_mib == 143_771 and spec.uuid == UUID


def test_the_topology_header_styled_for_a_terminal_still_parses() -> None:
    """nvidia-smi 580 underlines the header with terminal codes even when piped; before, every
    column name carried them and the GPU's row and affinities were lost."""
    saved = parse_saved(DATA / "nvidia-smi_topo_-m__H200__driver-580.159.04.txt")
    topology = saved.topology
    assert topology is not None
    assert topology.columns == ["GPU0", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    assert topology.paths == {"GPU0": {"GPU0": "X"}}
    assert topology.cpu_affinity == {"GPU0": "0-15"} and topology.numa_affinity == {"GPU0": "0"}
