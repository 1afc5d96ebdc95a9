"""The reliability plan's invariants (``../shared/docs/reliability-plan.md`` §6.1), checked offline
on what a run left: the events the streams stored, the jobs its clients submitted, and the
ledger's lease records and devices once the run went quiet.

- **I1, no double allocation**: on every device, the leases whose lives overlap (from ``created_ms``
  to ``ended_ms``, or still live) never hold more than it has: a whole device alone, shares within
  its memory and 100 % of its compute.
- **I2, one outcome per accepted request**: each job accepted by the stack (a submit answered, or
  stored on the stream) has exactly one first outcome among the events (granted, rejected, timed
  out, cancelled), counted once per event id; a job whose submit failed in a way that leaves it
  unknown whether it was accepted has at most one; no event names a job nobody submitted; every
  grant's lease ends in exactly one ``LeaseEnded``, and no ``LeaseEnded`` names a lease never
  granted.
- **I1, fencing tokens**: no two grants share a token, and on every device the leases' tokens
  rise in the order they were granted (a ledger that lost its token counter over a restart, and
  gave a token out again, shows here).
- **I1, as the streams tell it**: every grant the stream stored names a lease the ledger kept,
  of the same job and tenant and on the same slices, and every lease the ledger granted has its
  grant on the stream (so a ledger that lost a lease record, or a grant sent on a record the
  ledger does not hold, shows even where the records alone look consistent).
- **I3, nothing leaked**: once quiet, no lease is live and every device is whole again.
- **I4, quotas**: at the start of each lease, the leases then alive that charge a queue with a
  limit hold at most that limit, in capacity units (a whole device its ``capacity_units``; a
  share the larger of its memory and compute fractions of that).
- **I6, tenant isolation, as delivered**: every event a tenant's subjects carried is that
  tenant's (its ``tenant`` field, and the owner of the job it names).

I5 (stale tokens refused) and the rest of I6 (another tenant's commands refused) are checked by
the soak's clients as they send them: the answer is the evidence.

The functions are pure: the soak driver (``bench/soak/soak.py``) gathers their inputs, and unit
tests feed them made-up histories.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from xpupool.contracts import (
    AllocationGranted,
    JobCancelled,
    JobRejected,
    JobTimedOut,
    LeaseEnded,
)
from xpupool.ledger.ledger import LeaseRecord, NodeRecord, TakenSlice

__all__ = [
    "FIRST_OUTCOMES",
    "Violation",
    "check_fencing",
    "check_grants_recorded",
    "check_nothing_leaked",
    "check_no_double_allocation",
    "check_outcomes",
    "check_quota",
    "check_tenant_delivery",
    "slice_units",
]

SpanT = TypeVar("SpanT")

FIRST_OUTCOMES = (AllocationGranted, JobRejected, JobTimedOut, JobCancelled)


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which, about what (a job, lease or device), and how."""

    invariant: str
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant} {self.subject}: {self.detail}"


def check_outcomes(
    accepted: Iterable[str], uncertain: Iterable[str], stored: Sequence[tuple[str, object]]
) -> list[Violation]:
    """I2 over ``stored`` (event id, event) as a stream kept them, in order: copies of one event
    id count once; events other than job outcomes and lease ends are ignored."""
    accepted_ids, uncertain_ids = set(accepted), set(uncertain)
    seen: set[str] = set()
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    granted: dict[str, str] = {}  # lease -> job
    ended: Counter[str] = Counter()
    for event_id, event in stored:
        if event_id in seen:
            continue
        seen.add(event_id)
        if isinstance(event, FIRST_OUTCOMES):
            outcomes[event.job_id][type(event).__name__] += 1
            if isinstance(event, AllocationGranted):
                granted[event.lease_id] = event.job_id
        elif isinstance(event, LeaseEnded):
            ended[event.lease_id] += 1
    violations = []
    for job_id in sorted(accepted_ids | set(outcomes)):
        kinds = outcomes.get(job_id, Counter())
        count = sum(kinds.values())
        if job_id not in accepted_ids and job_id not in uncertain_ids:
            violations.append(
                Violation("I2", job_id, f"outcomes of a job never submitted: {kinds}")
            )
        elif job_id in accepted_ids and count != 1:
            violations.append(
                Violation("I2", job_id, f"{count} first outcomes for an accepted job: {kinds}")
            )
        elif count > 1:
            violations.append(Violation("I2", job_id, f"{count} first outcomes: {kinds}"))
    for lease_id, job_id in sorted(granted.items()):
        if ended[lease_id] != 1:
            violations.append(
                Violation("I2", lease_id, f"job {job_id}'s lease ended {ended[lease_id]} times")
            )
    for lease_id in sorted(set(ended) - set(granted)):
        violations.append(Violation("I2", lease_id, "LeaseEnded for a lease never granted"))
    return violations


def _alive_at_each_start(
    spans: Iterable[tuple[int, float, SpanT]],
) -> Iterator[tuple[int, list[SpanT]]]:
    """For each distinct start among ``spans`` ((start, end, item)), in order, the items alive
    then: started at or before it and not ended (an end at the same millisecond is over). One
    sweep over the spans sorted by start, not a scan of all of them per start."""
    ordered = sorted(spans, key=lambda span: span[0])
    alive: list[tuple[int, float, SpanT]] = []
    i = 0
    while i < len(ordered):
        start = ordered[i][0]
        while i < len(ordered) and ordered[i][0] == start:
            alive.append(ordered[i])
            i += 1
        alive = [span for span in alive if span[1] > start]
        yield start, [span[2] for span in alive]


def check_no_double_allocation(
    leases: Sequence[LeaseRecord], capacity_mib: Mapping[str, int]
) -> list[Violation]:
    """I1 over every lease record (live and ended): at each lease's start, what the leases alive
    then hold of each of its devices fits the device (``capacity_mib``: its memory)."""
    by_device: dict[str, list[tuple[int, float, tuple[str, TakenSlice]]]] = defaultdict(list)
    for lease in leases:
        end = float("inf") if lease.ended_ms is None else lease.ended_ms
        for s in lease.slices:
            by_device[s.device_id].append((lease.created_ms, end, (lease.lease_id, s)))
    violations = []
    for device_id, held in sorted(by_device.items()):
        memory = capacity_mib.get(device_id)
        for start, alive in _alive_at_each_start(held):
            names = sorted(lease_id for lease_id, _ in alive)
            if any(s.whole for _, s in alive) and len(alive) > 1:
                violations.append(
                    Violation("I1", device_id, f"a whole lease beside others at {start}: {names}")
                )
            used_memory = sum(s.memory_mib for _, s in alive if not s.whole)
            used_compute = sum(s.compute_pct for _, s in alive if not s.whole)
            if used_compute > 100 or (memory is not None and used_memory > memory):
                violations.append(
                    Violation(
                        "I1",
                        device_id,
                        f"shares over the device at {start} ({used_memory} MiB of {memory}, "
                        f"{used_compute} % compute): {names}",
                    )
                )
    return violations


def check_nothing_leaked(
    leases: Sequence[LeaseRecord], nodes: Sequence[NodeRecord]
) -> list[Violation]:
    """I3, once quiet: no lease live, and every device of every node free again."""
    violations = [
        Violation("I3", lease.lease_id, f"still {lease.state} after the run (job {lease.job_id})")
        for lease in leases
        if lease.state != "ended"
    ]
    for node in nodes:
        for device in node.devices:
            if (
                device.holders
                or device.exclusive
                or device.memory_free_mib != device.memory_total_mib
                or device.compute_free_pct != 100
            ):
                violations.append(
                    Violation(
                        "I3",
                        device.spec.device_id,
                        f"not free after the run: {device.holders} holders, "
                        f"{device.memory_free_mib} of {device.memory_total_mib} MiB, "
                        f"{device.compute_free_pct} % compute free",
                    )
                )
    return violations


def check_grants_recorded(
    stored: Sequence[tuple[str, object]], leases: Sequence[LeaseRecord]
) -> list[Violation]:
    """I1 across the two records of a grant: the stream's ``AllocationGranted`` events (by event
    id, copies once) and the ledger's lease records agree on which leases were granted, to
    which job and tenant, on which slices."""
    records = {lease.lease_id: lease for lease in leases}
    granted: dict[str, AllocationGranted] = {}
    seen: set[str] = set()
    for event_id, event in stored:
        if event_id in seen or not isinstance(event, AllocationGranted):
            continue
        seen.add(event_id)
        granted.setdefault(event.lease_id, event)
    violations = []
    for lease_id, grant in sorted(granted.items()):
        record = records.get(lease_id)
        if record is None:
            violations.append(
                Violation(
                    "I1", lease_id, f"granted to job {grant.job_id}; the ledger has no record"
                )
            )
            continue
        if (record.job_id, record.tenant) != (grant.job_id, grant.tenant):
            violations.append(
                Violation(
                    "I1",
                    lease_id,
                    f"granted to {grant.tenant}'s job {grant.job_id}; the ledger's record is "
                    f"{record.tenant}'s job {record.job_id}",
                )
            )
        sent = sorted((s.device_id, s.whole, s.memory_mib, s.compute_pct) for s in grant.slices)
        kept = sorted((s.device_id, s.whole, s.memory_mib, s.compute_pct) for s in record.slices)
        if sent != kept:
            violations.append(
                Violation("I1", lease_id, f"granted slices {sent}; the ledger's record {kept}")
            )
    for lease_id, record in sorted(records.items()):
        if record.granted_ms is not None and lease_id not in granted:
            violations.append(
                Violation(
                    "I1", lease_id, f"the ledger granted job {record.job_id}; no grant stored"
                )
            )
    return violations


def slice_units(taken: TakenSlice, memory_mib: int | None, capacity_units: float = 1.0) -> float:
    """What a slice charges its queue: a whole device its capacity units, a share the larger of
    its compute and memory fractions of them (the scheduler's ``demand_footprint``)."""
    if taken.whole:
        return capacity_units
    memory_fraction = taken.memory_mib / memory_mib if memory_mib else 0.0
    return max(taken.compute_pct / 100.0, memory_fraction) * capacity_units


def check_quota(
    leases: Sequence[LeaseRecord],
    limits_units: Mapping[str, float],
    capacity_mib: Mapping[str, int],
    capacity_units: Mapping[str, float] | None = None,
) -> list[Violation]:
    """I4 over every lease record (live and ended): at each lease's start, the leases alive then
    (as I1 counts them) that charge a queue of ``limits_units`` hold at most its limit.
    ``capacity_units`` gives a device's units (1.0, an A100, when it is not named)."""
    units_of = capacity_units or {}
    charged: dict[str, list[tuple[int, float, tuple[float, str]]]] = defaultdict(list)
    for lease in leases:
        if lease.queue not in limits_units:
            continue
        end = float("inf") if lease.ended_ms is None else lease.ended_ms
        units = sum(
            slice_units(s, capacity_mib.get(s.device_id), units_of.get(s.device_id, 1.0))
            for s in lease.slices
        )
        charged[lease.queue].append((lease.created_ms, end, (units, lease.lease_id)))
    violations = []
    for queue, held in sorted(charged.items()):
        limit = limits_units[queue]
        for start, alive in _alive_at_each_start(held):
            used = sum(units for units, _ in alive)
            if used > limit + 1e-6:
                names = sorted(lease_id for _, lease_id in alive)
                violations.append(
                    Violation(
                        "I4",
                        queue,
                        f"{used:.3f} units held at {start}, over its limit {limit}: {names}",
                    )
                )
    return violations


def check_tenant_delivery(
    delivered: Sequence[tuple[str, object]], job_owners: Mapping[str, str]
) -> list[Violation]:
    """I6 over what tenants' subjects carried, as (the subject's tenant, the event): an event
    naming another tenant, or a job another tenant submitted (``job_owners``), went to the
    wrong tenant."""
    violations = []
    for subject_tenant, event in delivered:
        named = getattr(event, "tenant", None) or None  # "" in events from before it was set
        job_id = getattr(event, "job_id", None)
        owner = job_owners.get(job_id) if isinstance(job_id, str) else None
        if named not in (None, subject_tenant) or owner not in (None, subject_tenant):
            violations.append(
                Violation(
                    "I6",
                    subject_tenant,
                    f"received {type(event).__name__} of tenant {named}, job {job_id} "
                    f"(submitted by {owner})",
                )
            )
    return violations


def check_fencing(leases: Sequence[LeaseRecord]) -> list[Violation]:
    """I1's fencing tokens over every granted lease record: unique, and rising on each device in
    the order of the grants (``granted_ms``, then the token for grants in the same millisecond,
    which a counter that went back would break all the same by repeating one)."""
    granted = [lease for lease in leases if lease.granted_ms is not None]
    violations = []
    holders: dict[int, list[str]] = defaultdict(list)
    for lease in granted:
        holders[lease.token].append(lease.lease_id)
    for token, lease_ids in sorted(holders.items()):
        if len(lease_ids) > 1:
            violations.append(
                Violation("I1", f"token {token}", f"given to {len(lease_ids)} leases: {lease_ids}")
            )
    by_device: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for lease in granted:
        assert lease.granted_ms is not None
        for s in lease.slices:
            by_device[s.device_id].append((lease.granted_ms, lease.token, lease.lease_id))
    for device_id, grants in sorted(by_device.items()):
        grants.sort()
        for (at, token, lease_id), (later_at, later_token, later_id) in itertools.pairwise(grants):
            if later_at > at and later_token <= token:
                violations.append(
                    Violation(
                        "I1",
                        device_id,
                        f"lease {later_id} granted at {later_at} with token {later_token}, "
                        f"not above {lease_id}'s {token} granted at {at}",
                    )
                )
    return violations
