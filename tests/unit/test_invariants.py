"""The soak's invariant checker (``xpupool.devstack.invariants``) on made-up histories: each
invariant is reported when broken, and a clean history passes."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import msgspec

from xpupool.contracts import (
    AllocationGranted,
    DeviceSlice,
    EndReason,
    JobReason,
    JobRejected,
    LeaseEnded,
    LeaseRenewed,
    Vendor,
)
from xpupool.devstack.invariants import (
    check_fencing,
    check_grants_recorded,
    check_no_double_allocation,
    check_nothing_leaked,
    check_outcomes,
    check_quota,
    check_tenant_delivery,
    slice_units,
)
from xpupool.ledger.ledger import LeaseRecord, TakenSlice

NOW = datetime(2026, 12, 7, tzinfo=UTC)


def grant(job: str, lease: str) -> AllocationGranted:
    return AllocationGranted(
        job_id=job,
        lease_id=lease,
        tenant="t",
        owner="o",
        fencing_token=1,
        granted_at=NOW,
        expires_at=NOW,
        slices=[],
        env={},
    )


def ended(job: str, lease: str) -> LeaseEnded:
    return LeaseEnded(
        job_id=job,
        lease_id=lease,
        tenant="t",
        reason=EndReason.RELEASED,
        fencing_token=1,
        ended_at=NOW,
    )


def rejected(job: str) -> JobRejected:
    return JobRejected(job_id=job, tenant="t", reason=JobReason.DUPLICATE_JOB)


def test_a_clean_history_passes_and_copies_of_one_event_count_once() -> None:
    stored = [
        ("g1", grant("a", "la")),
        ("g1", grant("a", "la")),  # the same event stored twice (past the duplicate window)
        ("r1", rejected("b")),
        ("e1", ended("a", "la")),
    ]
    assert check_outcomes({"a", "b"}, set(), stored) == []


def test_each_way_to_break_one_outcome_per_job_is_reported() -> None:
    stored = [
        ("g1", grant("twice", "l1")),
        ("r1", rejected("twice")),  # a second first outcome
        ("g2", grant("phantom", "l2")),  # nobody submitted it
        ("e2", ended("phantom", "l2")),
        ("g3", grant("unended", "l3")),  # its lease never ends
        ("e4", ended("x", "l4")),  # an end without a grant
        ("g5", grant("maybe", "l5")),  # an uncertain submit: one outcome is fine
        ("e5", ended("maybe", "l5")),
    ]
    violations = check_outcomes({"twice", "unended", "lost"}, {"maybe"}, stored)
    assert sorted((v.invariant, v.subject) for v in violations) == [
        ("I2", "l1"),  # twice's grant never ended either
        ("I2", "l3"),
        ("I2", "l4"),
        ("I2", "lost"),  # accepted, no outcome at all
        ("I2", "phantom"),
        ("I2", "twice"),
    ]


def lease(
    lease_id: str,
    start: int,
    end: int | None,
    *slices: TakenSlice,
    state: str = "ended",
    queue: str = "q",
) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lease_id,
        job_id=f"job-{lease_id}",
        tenant="t",
        owner="o",
        queue=queue,
        priority=500,
        state=state,
        slices=list(slices),
        token=1,
        ttl_ms=60_000,
        created_ms=start,
        granted_ms=start,
        expires_ms=start + 60_000,
        end_reason="released" if end is not None else None,
        end_detail="",
        ended_ms=end,
    )


def whole(device: str) -> TakenSlice:
    return TakenSlice(device, "n", True, 80_000, 100)


def share(device: str, memory: int, compute: int = 25) -> TakenSlice:
    return TakenSlice(device, "n", False, memory, compute)


def test_leases_one_after_another_on_a_device_are_no_double_allocation() -> None:
    leases = [
        lease("a", 0, 100, whole("d")),
        lease("b", 100, 200, whole("d")),  # starts the millisecond the first ended
        lease("c", 200, None, share("d", 40_000), share("d2", 10_000), state="active"),
        lease("e", 300, None, share("d", 40_000), state="active"),
    ]
    assert check_no_double_allocation(leases, {"d": 80_000, "d2": 80_000}) == []


def test_overlapping_grants_beyond_a_device_are_reported() -> None:
    leases = [
        lease("a", 0, 100, whole("d")),
        lease("b", 50, 150, share("d", 1_000)),  # beside a whole lease
        lease("c", 200, 300, share("d2", 50_000)),
        lease("e", 250, None, share("d2", 40_000), state="active"),  # memory over 80,000
        lease("f", 400, 500, share("d3", 100, 60), share("d3", 100, 60)),  # compute over 100
    ]
    violations = check_no_double_allocation(leases, {"d": 80_000, "d2": 80_000, "d3": 80_000})
    assert sorted({(v.invariant, v.subject) for v in violations}) == [
        ("I1", "d"),
        ("I1", "d2"),
        ("I1", "d3"),
    ]


def test_a_live_lease_after_the_run_is_a_leak() -> None:
    violations = check_nothing_leaked([lease("a", 0, None, whole("d"), state="active")], [])
    assert [(v.invariant, v.subject) for v in violations] == [("I3", "a")]


def sent(taken: TakenSlice) -> DeviceSlice:
    return DeviceSlice(
        device_id=taken.device_id,
        node_id=taken.node_id,
        vendor=Vendor.NVIDIA,
        model="A100",
        index=0,
        uuid="",
        memory_mib=taken.memory_mib,
        compute_pct=taken.compute_pct,
        whole=taken.whole,
    )


def granted_on(record: LeaseRecord, **changes: object) -> AllocationGranted:
    event = msgspec.structs.replace(
        grant(record.job_id, record.lease_id), slices=[sent(s) for s in record.slices]
    )
    return msgspec.structs.replace(event, **changes)


def test_grants_and_the_ledgers_records_agree_or_each_difference_is_reported() -> None:
    kept = lease("a", 0, 100, whole("d"))
    assert check_grants_recorded([("g", granted_on(kept)), ("g", granted_on(kept))], [kept]) == []
    other_slices = lease("b", 0, 100, whole("d2"))
    other_job = lease("c", 0, 100, whole("d3"))
    unsent = lease("e", 0, 100, whole("d4"))
    reserved_only = dataclasses.replace(lease("f", 0, 100, whole("d5")), granted_ms=None)
    stored = [
        ("g1", granted_on(other_slices, slices=[sent(whole("d9"))])),
        ("g2", granted_on(other_job, job_id="someone-else")),
        ("g3", grant("lost", "no-record")),
    ]
    violations = check_grants_recorded(stored, [other_slices, other_job, unsent, reserved_only])
    assert sorted(v.subject for v in violations) == ["b", "c", "e", "no-record"]
    assert {v.invariant for v in violations} == {"I1"}


def test_a_slice_charges_its_larger_fraction_of_the_devices_units() -> None:
    assert slice_units(whole("d"), 80_000, 2.0) == 2.0
    assert slice_units(share("d", 40_000, 25), 80_000) == 0.5
    assert slice_units(share("d", 8_000, 50), 80_000) == 0.5


def test_a_queue_over_its_limit_at_any_lease_start_is_reported() -> None:
    within = [
        lease("a", 0, 100, whole("d1"), queue="capped"),
        lease("b", 0, 100, whole("d2"), queue="capped"),
        lease("c", 100, 200, whole("d1"), share("d3", 40_000), queue="capped"),  # 1.5 after a
        lease("e", 0, None, whole("d4"), whole("d5"), whole("d6"), state="active"),  # no limit
    ]
    capacity = {f"d{i}": 80_000 for i in range(1, 8)}
    assert check_quota(within, {"capped": 2.0}, capacity) == []
    over = [*within, lease("f", 150, 300, whole("d7"), queue="capped")]  # 2.5 beside c
    violations = check_quota(over, {"capped": 2.0}, capacity)
    assert [(v.invariant, v.subject) for v in violations] == [("I4", "capped")]
    assert "2.500 units held at 150" in violations[0].detail
    # The same leases with d1 a device of two units are over from the start.
    assert check_quota(within, {"capped": 2.0}, capacity, {"d1": 2.0})


def test_an_event_on_another_tenants_subjects_is_reported() -> None:
    owners = {"job-a": "alpha", "job-b": "beta"}
    fine = [
        ("alpha", msgspec.structs.replace(grant("job-a", "la"), tenant="alpha")),
        ("beta", JobRejected(job_id="job-b", tenant="beta", reason=JobReason.DUPLICATE_JOB)),
        ("beta", LeaseRenewed(job_id="job-b", lease_id="lb", fencing_token=1, expires_at=NOW)),
        ("mallory", JobRejected(job_id="made-up", reason=JobReason.INVALID_REQUEST)),
    ]
    assert check_tenant_delivery(fine, owners) == []
    wrong = [
        ("beta", msgspec.structs.replace(grant("job-a", "la"), tenant="alpha")),
        ("mallory", LeaseRenewed(job_id="job-b", lease_id="lb", fencing_token=1, expires_at=NOW)),
    ]
    violations = check_tenant_delivery(wrong, owners)
    assert [(v.invariant, v.subject) for v in violations] == [("I6", "beta"), ("I6", "mallory")]


def test_fencing_tokens_unique_and_rising_on_each_device_or_reported() -> None:
    def granted(lease_id: str, at: int, token: int, *slices: TakenSlice) -> LeaseRecord:
        return dataclasses.replace(lease(lease_id, at, at + 10, *slices), token=token)

    rising = [
        granted("a", 0, 1, whole("d")),
        granted("b", 10, 5, whole("d")),
        granted("c", 10, 6, whole("d2")),  # the same millisecond elsewhere
        granted("e", 20, 3, whole("d2")),  # lower than c's, on the same device: a counter back
        dataclasses.replace(lease("f", 30, 40, whole("d")), token=1, granted_ms=None),  # reserved
    ]
    violations = check_fencing(rising)
    assert [(v.invariant, v.subject) for v in violations] == [("I1", "d2")]
    repeated = [granted("a", 0, 7, whole("d")), granted("b", 50, 7, whole("d3"))]
    assert [v.subject for v in check_fencing(repeated)] == ["token 7"]
