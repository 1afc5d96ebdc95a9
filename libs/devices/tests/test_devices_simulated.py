"""Simulated backend: profiles, specs, load following, fault injection, node death."""

from __future__ import annotations

import pytest

from xpupool.contracts import DeviceSpec, Health, Vendor
from xpupool.devices.backend import BackendUnavailable, DeviceBackend
from xpupool.devices.catalog import Catalog
from xpupool.devices.simulated import (
    Disappear,
    NodeKilled,
    Overheat,
    SimulatedBackend,
    Xid,
    parse_profile,
)


@pytest.fixture
def sim(catalog: Catalog) -> SimulatedBackend:
    """Two A100s, four 910Bs and a T4 on node-a."""
    return SimulatedBackend("node-a", "2xA100-80GB,4xAscend910B,T4", catalog, seed=7)


def by_id(specs: list[DeviceSpec]) -> dict[str, DeviceSpec]:
    return {s.device_id: s for s in specs}


def test_parse_profile() -> None:
    """Counts default to one; whitespace and 'X' are accepted."""
    assert parse_profile("2xA100-80GB, 4X Ascend910B,T4") == [
        (2, "A100-80GB"),
        (4, "Ascend910B"),
        (1, "T4"),
    ]


@pytest.mark.parametrize("bad", ["", " , ", "0xT4"])
def test_parse_profile_rejects(bad: str) -> None:
    """Empty profiles and zero counts are errors."""
    with pytest.raises(ValueError):
        parse_profile(bad)


def test_unknown_model_rejected(catalog: Catalog) -> None:
    """A model missing from the catalog fails at construction with the known list."""
    with pytest.raises(ValueError, match="unknown device model 'B9000'"):
        SimulatedBackend("n", "B9000", catalog)


def test_is_a_device_backend(sim: SimulatedBackend) -> None:
    """The simulator satisfies the DeviceBackend protocol."""
    assert isinstance(sim, DeviceBackend)
    assert sim.vendor is Vendor.SIMULATED


def test_specs_identity_and_catalog_data(sim: SimulatedBackend) -> None:
    """Ids are node/vendor+index per vendor; model, capacity, cost and domain come from the
    catalog."""
    specs = by_id(sim.specs())
    assert list(specs) == [
        "node-a/nvidia0", "node-a/nvidia1", "node-a/ascend0", "node-a/ascend1",
        "node-a/ascend2", "node-a/ascend3", "node-a/nvidia2",
    ]  # fmt: skip
    a100 = specs["node-a/nvidia0"]
    assert a100.model == "A100-SXM4-80GB" and a100.vendor is Vendor.NVIDIA
    assert a100.memory_mib == 81920 and a100.capacity_units == 1.0
    assert "bf16" in a100.capabilities and "mig" in a100.isolation
    assert a100.domain == "node-a/nvswitch0" == specs["node-a/nvidia1"].domain
    assert specs["node-a/ascend3"].domain == "node-a/hccs0"
    assert specs["node-a/nvidia2"].domain == "" and specs["node-a/nvidia2"].interconnect == "pcie"
    assert a100.uuid.startswith("GPU-") and a100.cost_per_hour > 0


def test_uuids_are_deterministic(catalog: Catalog) -> None:
    """The same node and index give the same uuid; another node gives another."""
    a = SimulatedBackend("node-a", "2xT4", catalog).specs()
    b = SimulatedBackend("node-a", "2xT4", catalog, seed=99).specs()
    c = SimulatedBackend("node-b", "2xT4", catalog).specs()
    assert [s.uuid for s in a] == [s.uuid for s in b]
    assert {s.uuid for s in a}.isdisjoint(s.uuid for s in c)
    assert len({s.uuid for s in a}) == 2


def test_domains_split_by_domain_size(catalog: Catalog) -> None:
    """Ten 910Bs fill one 8-chip HCCS domain and start a second."""
    specs = SimulatedBackend("n", "10x910B3", catalog).specs()
    assert [s.domain for s in specs] == ["n/hccs0"] * 8 + ["n/hccs1"] * 2


def test_sample_follows_load(sim: SimulatedBackend) -> None:
    """Memory and utilisation follow set_load; temperature and power rise with load."""
    idle = {s.device_id: s for s in sim.sample()}["node-a/nvidia0"]
    sim.set_load("node-a/nvidia0", 20_000, 80)
    busy = {s.device_id: s for s in sim.sample()}["node-a/nvidia0"]
    assert (idle.memory_used_mib, idle.util_pct) == (0, 0.0)
    assert (busy.memory_used_mib, busy.util_pct) == (20_000, 80.0)
    assert busy.temperature_c is not None and idle.temperature_c is not None
    assert busy.temperature_c > idle.temperature_c
    assert busy.power_w is not None and idle.power_w is not None and busy.power_w > idle.power_w
    assert busy.health is Health.HEALTHY


def test_load_is_capped(sim: SimulatedBackend) -> None:
    """Memory above the device total reads as the total; compute caps at 100%."""
    sim.set_load("node-a/nvidia2", 10**9, 400)
    t4 = {s.device_id: s for s in sim.sample()}["node-a/nvidia2"]
    assert (t4.memory_used_mib, t4.util_pct) == (15360, 100.0)


def test_set_load_validates(sim: SimulatedBackend) -> None:
    """Unknown devices and negative load are rejected."""
    with pytest.raises(KeyError):
        sim.set_load("node-a/nvidia9", 1, 1)
    with pytest.raises(ValueError):
        sim.set_load("node-a/nvidia0", -1, 0)


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68])
def test_application_xid_keeps_device_healthy(sim: SimulatedBackend, code: int) -> None:
    """Application XIDs are reported but leave the GPU healthy."""
    sim.inject("node-a/nvidia0", Xid(code=code))
    sample = {s.device_id: s for s in sim.sample()}["node-a/nvidia0"]
    assert sample.xid == code and sample.health is Health.HEALTHY


@pytest.mark.parametrize("code", [48, 63, 74, 79, 94])
def test_hardware_xid_makes_device_unhealthy(sim: SimulatedBackend, code: int) -> None:
    """Other XIDs make the GPU unhealthy until cleared."""
    sim.inject("node-a/nvidia1", Xid(code=code))
    sample = {s.device_id: s for s in sim.sample()}["node-a/nvidia1"]
    assert sample.xid == code and sample.health is Health.UNHEALTHY
    sim.clear("node-a/nvidia1")
    sample = {s.device_id: s for s in sim.sample()}["node-a/nvidia1"]
    assert sample.xid is None and sample.health is Health.HEALTHY


def test_overheat_degrades(sim: SimulatedBackend) -> None:
    """A temperature above the threshold degrades the device and names the reason."""
    sim.inject("node-a/ascend0", Overheat(temperature_c=97.0))
    info = next(i for i in sim.discover() if i.vendor is Vendor.ASCEND and i.index == 0)
    assert info.health is Health.DEGRADED and info.temperature_c == 97.0
    assert "temperature" in info.health_reasons[0]


def test_worst_fault_wins(sim: SimulatedBackend) -> None:
    """Overheating plus a hardware XID reads unhealthy, not degraded."""
    sim.inject("node-a/nvidia0", Overheat())
    sim.inject("node-a/nvidia0", Xid(code=79))
    sample = {s.device_id: s for s in sim.sample()}["node-a/nvidia0"]
    assert sample.health is Health.UNHEALTHY


def test_disappear_and_clear(sim: SimulatedBackend) -> None:
    """A disappeared device drops out of discover and sample, and returns after clear."""
    sim.inject("node-a/ascend1", Disappear())
    assert "node-a/ascend1" not in by_id(sim.specs())
    assert "node-a/ascend1" not in {s.device_id for s in sim.sample()}
    sim.clear("node-a/ascend1")
    assert "node-a/ascend1" in by_id(sim.specs())


def test_kill_node(sim: SimulatedBackend) -> None:
    """A killed node fails every call with NodeKilled until revived."""
    sim.kill_node()
    with pytest.raises(NodeKilled):
        sim.sample()
    with pytest.raises(BackendUnavailable):
        sim.discover()
    sim.revive_node()
    assert len(sim.sample()) == 7


def test_close(sim: SimulatedBackend) -> None:
    """A closed backend refuses further calls."""
    sim.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        sim.sample()


def test_deterministic_samples(catalog: Catalog) -> None:
    """The same seed and load give identical samples."""
    a = SimulatedBackend("n", "2xH20", catalog, seed=3)
    b = SimulatedBackend("n", "2xH20", catalog, seed=3)
    assert a.sample() == b.sample()


def test_mig_profile_lists_instances_as_units(catalog: Catalog) -> None:
    """``MODEL:mig=...`` simulates a GPU in MIG mode: each instance is a unit with a MIG- UUID,
    its parent's UUID, its profile and slices, and its own memory load."""
    sim = SimulatedBackend("n", "A100-80GB:mig=3g.40gb+2g.20gb+1g.10gb,T4", catalog)
    specs = sim.specs()
    assert sim.unit_ids == [s.device_id for s in specs] == [
        "n/nvidia0/mig1.0", "n/nvidia0/mig2.0", "n/nvidia0/mig3.0", "n/nvidia1",
    ]  # fmt: skip
    migs = specs[:3]
    assert sim.device_ids == ["n/nvidia0", "n/nvidia1"]
    assert all(s.uuid.startswith("MIG-") and s.isolation == ["mig"] for s in migs)
    assert len({s.uuid for s in migs}) == 3 and {s.parent_uuid for s in migs} == {
        sim.discover()[0].uuid
    }
    assert [s.memory_mib for s in migs] == [40960, 20480, 10240]
    assert [(p.profile, p.gpu_slices, p.slices_total) for s in migs if (p := s.partition)] == [
        ("3g.40gb", 3, 7), ("2g.20gb", 2, 7), ("1g.10gb", 1, 7),
    ]  # fmt: skip
    assert specs[3].partition is None and specs[3].parent_uuid is None
    sim.set_load("n/nvidia0/mig2.0", 99_999, 80)
    used = {s.device_id: s.memory_used_mib for s in sim.sample()}
    assert used == {"n/nvidia0/mig1.0": 0, "n/nvidia0/mig2.0": 20480, "n/nvidia0/mig3.0": 0,
                    "n/nvidia1": 0}  # fmt: skip
    assert sim.discover()[0].memory_used_mib == 20480


@pytest.mark.parametrize(
    ("profile", "error"),
    [
        ("T4:mig=1g.5gb", "T4 has no MIG"),
        ("A100-80GB:mig=3g.20gb", "not listed for A100-SXM4-80GB"),
        ("A100-80GB:mig=7g.79gb+1g.10gb", "need 8 of 7"),
        ("A100-80GB:mps=2", "bad device option"),
    ],
)
def test_mig_profile_rejects(catalog: Catalog, profile: str, error: str) -> None:
    """MIG on a model without it, a profile the catalog does not list, more than seven slices,
    or an unknown option fail at construction."""
    with pytest.raises(ValueError, match=error):
        SimulatedBackend("n", profile, catalog)
