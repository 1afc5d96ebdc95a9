"""The scheduler's admission on its kept copy of the ledger (``admit_arrivals``) against a real
redis-server: a lone arrival is placed on the copy without a read while the change feed says it
is current, and one placed on a copy the ledger has moved past is decided again on a read and
still granted at admission, never left to a cycle."""

from __future__ import annotations

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceDemand, JobRequested
from xpupool.ledger import AdmissionLimits, Ledger, SliceClaim
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.handlers import Arrival, SchedulerDeps, admit_arrivals
from xpupool.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.integration


def _arrival(job_id: str) -> Arrival:
    request = JobRequested(job_id=job_id, tenant="t", device=DeviceDemand(memory_mib=1024))
    return Arrival(request, 500, AdmissionLimits(), {})


def _views(deps: SchedulerDeps, view: str) -> float:
    value = deps.metrics.registry.get_sample_value(
        "xpupool_scheduler_admission_views_total", {"view": view}
    )
    return value or 0.0


async def _deps_on_a_current_copy(ledger: Ledger) -> SchedulerDeps:
    """Deps whose kept copy is current and whose feed counts as live (no follower runs here,
    so what the test changes next goes unannounced, as a change still on its way would)."""
    specs = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    deps.snapshots.note_change(True)
    await deps.snapshots.read_pool(ledger, deps.config.current())
    assert await deps.snapshots.kept_pool(deps.config.current()) is not None
    return deps


async def test_a_lone_arrival_is_placed_on_the_current_kept_copy(ledger: Ledger) -> None:
    deps = await _deps_on_a_current_copy(ledger)
    reads = deps.snapshots.last
    [result] = await admit_arrivals([_arrival("a")], deps)
    assert result.ok and result.outcome == "granted"
    assert deps.snapshots.last is reads  # no read of its own
    assert (_views(deps, "kept"), _views(deps, "changed")) == (1.0, 0.0)


async def test_a_placement_on_a_stale_copy_is_decided_again_on_a_read(ledger: Ledger) -> None:
    deps = await _deps_on_a_current_copy(ledger)
    # Another scheduler takes a whole device behind this one's back (unannounced here).
    taken = reservation("other", SliceClaim("n1/nvidia0", whole=True))
    assert (await ledger.reserve(taken)).ok
    [result] = await admit_arrivals([_arrival("b")], deps)
    assert result.ok and result.outcome == "granted", result
    assert (_views(deps, "kept"), _views(deps, "changed")) == (0.0, 1.0)
    lease = await ledger.get_lease(result.lease_id)
    assert lease is not None and [s.device_id for s in lease.slices] == ["n1/nvidia1"]
    assert await ledger.pending_jobs() == [] and deps.last_pending == 0
