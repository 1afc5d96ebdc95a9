"""A collector registers the share limits its node runs, not every one the catalog lists, so the
scheduler marks a share enforced only where something holds the job to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_collector_overuse import ProcessBackend
from xpupool.contracts import Vendor
from xpupool.devices import SimulatedBackend, load_catalog
from xpupool.devices.enforcement import slice_enforced
from xpupool.ledger import Ledger
from xpupool.telemetry_collector.handlers import CollectorDeps, register_node
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.settings import CollectorSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


async def _registered(
    ledger: Ledger, backend: ProcessBackend | SimulatedBackend, share_limits: str
) -> list[list[str]]:
    deps = CollectorDeps(
        ledger=ledger,
        backend=backend,
        catalog=load_catalog(None),
        settings=CollectorSettings(node_id=backend.node_id, share_limits=share_limits),
        health=HealthModel(missed_limit=3),
    )
    await register_node(deps)
    nodes = [n for n in await ledger.nodes() if n.node_id == backend.node_id]
    return [d.spec.isolation for n in nodes for d in n.devices]


async def test_a_real_node_without_mps_registers_no_share_limit(
    ledger: Ledger, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no control pipe there
    (isolation,) = await _registered(ledger, ProcessBackend("gpu-node", []), "auto")
    assert isolation == ["mig"]
    assert not slice_enforced(Vendor.NVIDIA, isolation, whole=False)


async def test_a_node_named_to_run_mps_registers_it(ledger: Ledger) -> None:
    (isolation,) = await _registered(ledger, ProcessBackend("gpu-node", []), "mps")
    assert isolation == ["mig", "mps"]
    assert slice_enforced(Vendor.NVIDIA, isolation, whole=False)


async def test_named_limits_and_simulated_nodes(ledger: Ledger) -> None:
    assert await _registered(ledger, ProcessBackend("gpu-node", []), "hami-core") == [
        ["mig", "hami-core"]
    ]
    simulated = SimulatedBackend("sim-node", "1xA100-80GB", load_catalog(None))
    assert await _registered(ledger, simulated, "auto") == [["mig", "mps", "hami-core"]]
    assert await _registered(ledger, simulated, "none") == [["mig"]]
