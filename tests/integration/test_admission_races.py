"""Admission races against a real redis-server: a scheduling cycle's commit that races a job's
other ends (its tenant's cancel, a peer replica's rejection) grants nothing and preempts nobody;
one job id twice in an admission batch gets one answer per request; a queue that may not borrow
stops at its guarantee whichever replica decides; a quota counter returns to zero."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceDemand, JobReason, JobRejected, JobRequested, encode
from xpupool.ledger import Admission, AdmissionLimits, Ledger, SliceClaim, UsageClaim, audit
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.handlers import (
    Arrival,
    SchedulerDeps,
    admit_arrivals,
    admit_job,
    place_on_arrival,
    schedule_cycle,
)
from xpupool.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.integration


async def _one_gpu(ledger: Ledger) -> None:
    assert (await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)).ok


async def _pending(ledger: Ledger, job: str) -> None:
    admitted = await ledger.pend(
        job, 500, b'{"job_id": "%s"}' % job.encode(), None, "queued", tenant="t"
    )
    assert admitted.ok and admitted.outcome == "pending"


async def test_a_cycle_commit_after_a_cancel_does_not_grant_the_cancelled_job(
    ledger: Ledger,
) -> None:
    """A cycle listed the job while it waited and decided to place it; the tenant cancels it
    before the commit lands (JobCancelled is queued). The commit must be refused: a grant as
    well would be a second terminal outcome, and the device would be held for a job nobody
    waits for."""
    await _one_gpu(ledger)
    await _pending(ledger, "j")
    assert (await ledger.cancel_job("j", "t")).outcome == "cancelled"
    committed = await ledger.reserve(reservation("j", SliceClaim("n1/nvidia0", whole=True)))
    assert not committed.ok and committed.reason == "job_finished"
    assert (await ledger.get_job("j")).state == "cancelled"  # type: ignore[union-attr]
    assert await ledger.leases() == []
    assert await audit(ledger) == []


async def test_a_cycle_commit_after_a_peer_rejected_the_job_does_not_grant_it(
    ledger: Ledger,
) -> None:
    """Two replicas decided the same waiting job on different queue files (one reloaded it):
    one rejected it (JobRejected queued), the other's reservation must not grant it too."""
    await _one_gpu(ledger)
    await _pending(ledger, "j")
    assert (await ledger.drop_pending("j", "unknown_queue", "queue", "gone")).ok
    committed = await ledger.reserve(reservation("j", SliceClaim("n1/nvidia0", whole=True)))
    assert not committed.ok and committed.reason == "job_finished"
    assert await ledger.leases() == []


def _deps(ledger: Ledger) -> SchedulerDeps:
    return SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))


async def test_one_job_id_from_two_tenants_in_one_batch_gets_an_answer_each(
    ledger: Ledger,
) -> None:
    """Job ids are global. Two tenants submit the same id at the same moment, and the two
    requests land in one admission batch, placed on arrival together: the first is admitted
    (here granted), the second refused ``duplicate_job``. Neither may be silently dropped (a
    placement decided for one tenant's request must not be offered with the other's)."""
    await _one_gpu(ledger)
    deps = _deps(ledger)
    first = JobRequested(job_id="x", tenant="a")
    second = JobRequested(job_id="x", tenant="b")
    results = await admit_arrivals(
        [Arrival(first, 500, AdmissionLimits(), {}), Arrival(second, 500, AdmissionLimits(), {})],
        deps,
    )
    assert results[0].ok and results[0].outcome == "granted", results[0]
    assert not results[1].ok and results[1].reason == "duplicate_job", results[1]
    lease = await ledger.get_lease(results[0].lease_id)
    assert lease is not None and lease.tenant == "a"


async def test_the_first_of_a_job_ids_duplicates_in_one_batch_is_the_one_placed(
    ledger: Ledger,
) -> None:
    """The job id is the idempotency key: of two requests with one id in one batch, the first
    admission stands (as it does across batches), so the grant is for what the first asked (a
    whole device), not the placement of the other (a share), which is refused with a word."""
    await _one_gpu(ledger)
    deps = _deps(ledger)
    whole = JobRequested(job_id="y", tenant="t")
    share = JobRequested(job_id="y", tenant="t", device=DeviceDemand(memory_mib=1024))
    results = await admit_arrivals(
        [Arrival(whole, 500, AdmissionLimits(), {}), Arrival(share, 500, AdmissionLimits(), {})],
        deps,
    )
    assert results[0].ok and results[0].outcome == "granted", results[0]
    assert not results[1].ok and results[1].reason == "duplicate_job", results[1]
    lease = await ledger.get_lease(results[0].lease_id)
    assert lease is not None and [s.whole for s in lease.slices] == [True]
    assert await audit(ledger) == []


async def test_a_refused_first_duplicate_does_not_drop_the_other_tenants_request(
    ledger: Ledger,
) -> None:
    """The first request of an id is refused (its tenant is over its pending limit): the second
    tenant's request with that id is admitted on its own, never dropped without an answer."""
    await _one_gpu(ledger)
    deps = _deps(ledger)
    limited = JobRequested(job_id="z", tenant="a")
    other = JobRequested(job_id="z", tenant="b")
    results = await admit_arrivals(
        [
            Arrival(limited, 500, AdmissionLimits(max_pending=0), {}),
            Arrival(other, 500, AdmissionLimits(), {}),
        ],
        deps,
    )
    assert results[0].reason == "too_many_pending", results[0]
    assert results[1].ok and results[1].outcome in ("granted", "pending"), results[1]
    job = await ledger.get_job("z")
    assert job is not None and job.state in ("leased", "pending")


async def test_a_duplicate_id_of_another_tenant_is_rejected_through_admit_job(
    ledger: Ledger,
) -> None:
    """``admit_job`` end to end on the ledger: the second tenant's request with a taken id is
    answered with a rejection naming the reason, whether or not it shared a batch."""
    await _one_gpu(ledger)
    deps = _deps(ledger)
    first, second = await asyncio.gather(
        admit_job(JobRequested(job_id="w"), deps, tenant="a"),
        admit_job(JobRequested(job_id="w"), deps, tenant="b"),
    )
    assert first == []
    assert len(second) == 1 and isinstance(second[0], JobRejected)
    assert second[0].reason is JobReason.DUPLICATE_JOB


STRICT_QUEUES = """
queues:
  - {name: strict, guaranteed: {units: 0.5}, over_quota: false, tenants: [t]}
"""


async def test_a_queue_that_may_not_borrow_stops_at_its_guarantee_across_replicas(
    ledger: Ledger, tmp_path: Path
) -> None:
    """A queue with ``over_quota: false`` stops at its guarantee (half a unit here). Two
    scheduler replicas place one arrival each (half a device) on arrival, on reads taken before
    either commits (nothing serialises placements on arrival between replicas): the ledger, which
    re-checks every quota in the same step as the grant, must refuse the second, as it does a
    limit."""
    specs = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    path = tmp_path / "queues.yaml"
    path.write_text(STRICT_QUEUES)
    replicas = [
        SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(path))
        for _ in range(2)
    ]
    arrivals = [
        Arrival(
            JobRequested(
                job_id=f"s{i}", tenant="t", queue="strict", device=DeviceDemand(compute_pct=50)
            ),
            500,
            AdmissionLimits(),
            {},
        )
        for i in range(2)
    ]
    decided = [
        (await place_on_arrival([arrival], deps, kept=False))[0]
        for arrival, deps in zip(arrivals, replicas, strict=True)
    ]
    assert all(f"s{i}" in placed for i, placed in enumerate(decided)), decided
    results = await ledger.admit_many(
        [
            Admission(f"s{i}", 500, b"{}", None, "queued", tenant="t", placement=placed[f"s{i}"][1])
            for i, placed in enumerate(decided)
        ]
    )
    assert [r.outcome for r in results] == ["granted", "pending"], results
    assert results[1].reason == "quota_exceeded"
    assert (await ledger.usage("strict"))["units"] <= 0.5 + 1e-9


async def test_no_lease_is_preempted_for_a_job_that_ended_before_the_cycle_committed(
    ledger: Ledger,
) -> None:
    """A cycle listed a waiting job and decided to preempt a lease for it; the tenant cancelled
    the job before the cycle sent the preemption. The victim must keep its lease: ending it
    would destroy its work for a job nobody waits for."""
    await _one_gpu(ledger)
    assert (await ledger.reserve(reservation("victim", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.grant("lease-victim")).ok
    await _pending(ledger, "urgent")
    assert (await ledger.cancel_job("urgent", "t")).outcome == "cancelled"
    outbox = ledger.key("outbox", "scheduler")
    before = await ledger.redis.xlen(outbox)
    refused = await ledger.request_preemption("lease-victim", "urgent")
    assert not refused.ok and refused.reason == "job_finished", refused
    assert await ledger.redis.xlen(outbox) == before
    lease = await ledger.get_lease("lease-victim")
    assert lease is not None and lease.preempted_for == ""


async def test_a_quota_counter_comes_back_to_zero_after_every_lease_ends(ledger: Ledger) -> None:
    """A share's quota claim rarely has a short decimal form (a third of a device here). The
    counter must give back exactly what it took: a residue left by each lease adds up, the
    same sign every time for the same share, until the counter no longer says what the live
    leases hold, and a queue filled to its limit exactly is refused by the ledger although the
    scheduler (which counts the leases' own records) finds it fits: a cycle that decides the
    same refused reservation again and again."""
    await _one_gpu(ledger)
    third = 1 / 3
    for i in range(20):
        claim = [UsageClaim("q", "units", third, 1.0)]
        taken = await ledger.reserve(
            reservation(f"j{i}", SliceClaim("n1/nvidia0", 1024, 33), usage=claim)
        )
        assert taken.ok, taken
        assert (await ledger.end(f"lease-j{i}", "released")).ok
        assert (await ledger.usage("q"))["units"] == 0.0, i
    # Three thirds fill the limit exactly.
    for i in range(3):
        claim = [UsageClaim("q", "units", third, 1.0)]
        taken = await ledger.reserve(
            reservation(f"f{i}", SliceClaim("n1/nvidia0", 1024, 33), usage=claim)
        )
        assert taken.ok, taken


async def test_a_waiting_job_whose_queue_a_reload_took_from_its_tenant_is_rejected(
    ledger: Ledger, tmp_path: Path
) -> None:
    """Its tenant could charge the queue when the job arrived (checked then); the queue file
    was reloaded since without the tenant on the queue. The next cycle rejects the waiting job
    (``queue_not_allowed``) instead of placing it and charging a queue its tenant no longer
    may spend; under the old file the same cycle leaves it waiting."""
    queues = tmp_path / "queues.yaml"
    allowed = "queues:\n  - {name: shared, tenants: [t]}\n"
    queues.write_text(allowed)
    await _one_gpu(ledger)  # held by another job: the request waits for it
    assert (await ledger.reserve(reservation("other", SliceClaim("n1/nvidia0", whole=True)))).ok
    request = JobRequested(job_id="q1", tenant="t", queue="shared")
    admitted = await ledger.pend("q1", 500, encode(request), None, "queued", tenant="t")
    assert admitted.ok and admitted.outcome == "pending"

    await schedule_cycle(_deps_of(ledger, queues))  # nowhere to place it: it waits
    assert (await ledger.get_job("q1")).state == "pending"  # type: ignore[union-attr]

    queues.write_text(allowed.replace("tenants: [t]", "tenants: [u]"))
    await schedule_cycle(_deps_of(ledger, queues))
    job = await ledger.get_job("q1")
    assert job is not None and (job.state, job.reason) == ("rejected", "queue_not_allowed")
    entries: Any = await ledger.redis.xrange(ledger.key("outbox", "scheduler"))
    rejected = [f for _, f in entries if f[b"kind"] == b"rejected"]
    assert [(f[b"job_id"], f[b"field"]) for f in rejected] == [(b"q1", b"queue")]
    assert await audit(ledger) == []


def _deps_of(ledger: Ledger, queues: Path) -> SchedulerDeps:
    return SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(queues))


async def test_the_message_that_admitted_an_ended_job_is_told_apart_from_a_resubmission(
    ledger: Ledger,
) -> None:
    """A stream message delivered again after its job ended (its acknowledgement lost to a crash)
    is the same request: answered ``job_redelivered``, nothing to publish. The same request in
    another message (a retry, on the stream or by request) is answered with where the job stands
    and how it ended, nothing to publish either; another request under the job id is a
    resubmission: ``duplicate_job``, saying how the job ended."""
    body = encode(JobRequested(job_id="r", tenant="t"))
    first = Admission("r", 500, body, None, "queued", tenant="t", source="XPUPOOL_JOBS:7")
    (admitted,) = await ledger.admit_many([first])
    assert admitted.ok and admitted.outcome == "pending"
    assert (await ledger.cancel_job("r", "t")).outcome == "cancelled"
    (again,) = await ledger.admit_many([first])
    assert not again.ok and again.reason == "job_redelivered"
    retried = Admission("r", 500, body, None, "queued", tenant="t", source="XPUPOOL_JOBS:9")
    (retry,) = await ledger.admit_many([retried])
    assert not retry.ok and retry.reason == "job_cancelled" and retry.detail == "it was cancelled"
    (by_request,) = await ledger.admit_many([Admission("r", 500, body, None, "queued", tenant="t")])
    assert not by_request.ok and by_request.reason == "job_cancelled"
    other = encode(JobRequested(job_id="r", tenant="t", labels={"attempt": "2"}))
    (refused,) = await ledger.admit_many([Admission("r", 500, other, None, "queued", tenant="t")])
    assert not refused.ok and refused.reason == "duplicate_job", refused
    assert "cancelled" in refused.detail


@pytest.mark.parametrize("placed", [False, True], ids=["waiting", "leased"])
async def test_another_request_under_a_live_jobs_id_is_refused_and_the_job_goes_on(
    ledger: Ledger, placed: bool
) -> None:
    """A job waits (or runs) and its tenant sends another request under its id: the newcomer is
    refused ``duplicate_job`` saying where the job stands, never ignored without a word; the
    same request again is a retry (ignored while the job waits, ``job_leased`` once granted).
    The job itself is left as it was."""
    if placed:
        await _one_gpu(ledger)
    deps = _deps(ledger)
    asked = JobRequested(job_id="live", tenant="t")
    (first,) = await admit_arrivals([Arrival(asked, 500, AdmissionLimits(), {})], deps)
    assert first.ok and first.outcome == ("granted" if placed else "pending"), first
    other = JobRequested(job_id="live", tenant="t", device=DeviceDemand(memory_mib=1024))
    (refused,) = await admit_job(other, deps, tenant="t")
    assert isinstance(refused, JobRejected) and refused.reason is JobReason.DUPLICATE_JOB
    state = "leased" if placed else "pending"
    assert refused.detail == f"job live is {state} with another request; submit with a new job id"
    assert await admit_job(asked, deps, tenant="t") == []
    job = await ledger.get_job("live")
    assert job is not None and job.state == state
    if placed:
        assert job.lease_id == first.lease_id
        assert await audit(ledger) == []
