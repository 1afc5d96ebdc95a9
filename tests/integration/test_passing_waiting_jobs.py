"""New requests placed on arrival past jobs that wait, against a real redis-server: only where
none of the waiting jobs could go, judged by a cycle at a pending sequence the ledger checks."""

from __future__ import annotations

import pytest

from tests.integration.ledger_builders import reservation
from xpupool.contracts import DeviceSelector, DeviceSpec, GangSpec, JobRequested, Vendor
from xpupool.ledger import AdmissionLimits, Ledger, SliceClaim, audit
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.handlers import Arrival, SchedulerDeps, admit_arrivals, schedule_cycle
from xpupool.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.integration


def _spec(node: str, index: int, model: str) -> DeviceSpec:
    return DeviceSpec(
        device_id=f"{node}/gpu{index}",
        vendor=Vendor.NVIDIA,
        model=model,
        index=index,
        uuid=f"GPU-{node}-{index}",
        memory_mib=81920 if model == "A100" else 15360,
    )


def _arrival(job_id: str, model: str, count: int = 1) -> Arrival:
    request = JobRequested(
        job_id=job_id,
        tenant="t",
        count=count,
        selector=DeviceSelector(models=[model]),
        gang=GangSpec(same_node=True) if count > 1 else None,
    )
    return Arrival(request, 500, AdmissionLimits(), {})


def _passes(deps: SchedulerDeps, outcome: str) -> float:
    value = deps.metrics.registry.get_sample_value(
        "xpupool_scheduler_waiting_passes_total", {"outcome": outcome}
    )
    return value or 0.0


async def _two_models(ledger: Ledger) -> SchedulerDeps:
    """Two A100s on ``a`` (one taken by someone else) and two T4s on ``t``; a gang of two
    A100s that cannot fit waits, and a cycle has judged it."""
    for node, model in (("a", "A100"), ("t", "T4")):
        specs = [_spec(node, i, model) for i in range(2)]
        assert (await ledger.register_node(node, specs, 64_000, 256_000)).ok
    assert (await ledger.reserve(reservation("held", SliceClaim("a/gpu0", whole=True)))).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    [gang] = await admit_arrivals([_arrival("gang", "A100", count=2)], deps)
    assert gang.outcome == "pending" and deps.last_pending
    await schedule_cycle(deps)
    assert deps.waiting is not None
    assert [p.request.job_id for p in deps.waiting.waiting] == ["gang"]
    return deps


async def test_arrivals_are_placed_past_a_gang_that_still_waits(ledger: Ledger) -> None:
    """While the A100 gang waits (it cannot fit: one of the two A100s is held), arrivals are
    decided after it, as a cycle would, and placed at once: a T4 job and an A100 job, the
    latter on the A100 the gang cannot use yet. Nothing else is left pending."""
    deps = await _two_models(ledger)
    [t4] = await admit_arrivals([_arrival("t4", "T4")], deps)
    assert t4.ok and t4.outcome == "granted", t4
    [a100] = await admit_arrivals([_arrival("a100", "A100")], deps)
    assert a100.outcome == "granted", a100
    lease = await ledger.get_lease(a100.lease_id)
    assert lease is not None and [s.device_id for s in lease.slices] == ["a/gpu1"]
    assert _passes(deps, "placed") == 2.0
    assert [job.job_id for _, job in await ledger.pending_jobs()] == ["gang"]
    assert await audit(ledger) == []


async def test_a_gang_that_would_now_fit_holds_arrivals_back_for_its_cycle(
    ledger: Ledger,
) -> None:
    """The held A100 is released: the gang would now fit, so an arrival is not placed (it
    waits, and joins the jobs arrivals are decided with); the cycle it wakes grants the gang
    first, then the arrival on what is left."""
    deps = await _two_models(ledger)
    assert (await ledger.end("lease-held", "released")).ok
    deps.snapshots.invalidate()  # no change feed here: the next read sees the release
    [t4] = await admit_arrivals([_arrival("t4", "T4")], deps)
    assert t4.outcome == "pending" and t4.reason == "", t4
    assert _passes(deps, "held_back") == 1.0 and deps.wake.is_set()
    assert deps.waiting is not None
    assert [p.request.job_id for p in deps.waiting.waiting] == ["gang", "t4"]
    await schedule_cycle(deps)
    assert await ledger.pending_jobs() == []
    assert deps.waiting is not None and deps.waiting.waiting == ()
    assert await audit(ledger) == []


async def test_a_job_that_started_waiting_unseen_is_never_overtaken(ledger: Ledger) -> None:
    """Another replica admits a job that waits (the pending sequence moves past the
    judgement): this replica's next T4 placement, judged before it, is refused by the ledger
    and waits behind it, until a cycle judges the queue again."""
    deps = await _two_models(ledger)
    other = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    other.last_pending = 1  # it knows jobs wait and has judged nothing: it places nothing
    [unseen] = await admit_arrivals([_arrival("unseen", "T4", count=2)], other)
    assert unseen.outcome == "pending"
    [late] = await admit_arrivals([_arrival("late", "T4")], deps)
    assert late.outcome == "pending" and late.reason == "jobs_waiting", late
    assert _passes(deps, "refused") == 1.0
    assert deps.waiting is None  # its own wait did not come right after the judged ones
    pending = [job.job_id for _, job in await ledger.pending_jobs()]
    assert pending == ["gang", "unseen", "late"]
    # A cycle reads the queue again and places what fits, in order: the two T4s go to
    # "unseen" (a gang of two T4s, first in line); the gang and "late" still wait.
    await schedule_cycle(deps)
    assert deps.waiting is not None
    assert sorted(p.request.job_id for p in deps.waiting.waiting) == ["gang", "late"]
    assert await audit(ledger) == []
