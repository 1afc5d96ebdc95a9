"""Placement on admission (``pend.lua`` with a placement) against a real redis-server: a new job
the scheduler found room for is granted in its admission step, and every rule that would make it
wait or refuse it still holds."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import DeviceSample
from xpupool.ledger import (
    VIEW_CHANGED,
    Admission,
    AdmissionLimits,
    HostClaim,
    Ledger,
    Reservation,
    SliceClaim,
    SliceMeta,
    UsageClaim,
    audit,
    new_lease_secret,
)

pytestmark = pytest.mark.integration


async def _two_gpus(ledger: Ledger) -> None:
    result = await ledger.register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000
    )
    assert result.ok


def _placed(job: str, *slices: SliceClaim, **kwargs: object) -> Reservation:
    return reservation(job, *slices, secret=new_lease_secret(), **kwargs)


def _admission(job: str, placement: Reservation | None = None, **kwargs: object) -> Admission:
    fields: dict[str, object] = dict(
        job_id=job,
        priority=500,
        request_json=b'{"job_id": "%s"}' % job.encode(),
        max_wait_ms=None,
        reason="queued",
        tenant="t",
        placement=placement,
    )
    fields.update(kwargs)
    return Admission(**fields)  # type: ignore[arg-type]


async def test_a_placed_admission_is_granted_in_one_step(ledger: Ledger) -> None:
    """The job is leased when the script returns: active lease with a fencing token, the grant
    queued in the lease-manager's outbox, nothing left in the pending queue."""
    await _two_gpus(ledger)
    placement = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [result] = await ledger.admit_many([_admission("a", placement)])
    assert result.ok and result.outcome == "granted"
    assert result.lease_id == "lease-a" and result.token > 0
    lease = await ledger.get_lease("lease-a")
    assert lease is not None and lease.state == "active" and lease.token == result.token
    job = await ledger.get_job("a")
    assert job is not None and job.state == "leased"
    assert await ledger.pending_jobs() == []
    assert await ledger.pending_count("t") == 0
    # The grant is the scheduler's to publish (the direct outbox), not the lease-manager's.
    assert await ledger.redis.xrange(ledger.key("outbox", "lease-manager")) == []
    direct: Any = await ledger.redis.xrange(ledger.key("outbox", "direct"))
    assert [(_s(i), fields[b"kind"]) for i, fields in direct] == [(result.entry, b"granted")]
    assert ledger.granted_lease(result) == lease  # the answer carries the lease as stored
    await ledger.confirm_direct([result.entry])
    assert await ledger.redis.xrange(ledger.key("outbox", "direct")) == []
    assert await audit(ledger) == []


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_a_refused_placement_leaves_the_job_waiting(ledger: Ledger) -> None:
    """A placement decided on a stale view (the device is taken by now) is no error: the job
    is admitted to the pending queue as if no placement had been found, with nothing taken."""
    await _two_gpus(ledger)
    assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia0", whole=True)))).ok
    stale = _placed("b", SliceClaim("n1/nvidia0", 1024, 10))
    [result] = await ledger.admit_many([_admission("b", stale)])
    assert result.ok and result.outcome == "pending" and result.reason == "insufficient_capacity"
    assert [job.job_id for _, job in await ledger.pending_jobs()] == ["b"]
    assert await ledger.get_lease("lease-b") is None
    assert await audit(ledger) == []


async def test_a_placement_on_a_kept_view_is_taken_only_while_the_ledger_shows_it(
    ledger: Ledger,
) -> None:
    """A placement decided on a kept copy carries the view it was decided on: granted while the
    ledger still shows that view; after any change since (even one that leaves its devices
    free), or on another redis-server process, the admission is refused with nothing written
    (``view_changed``), for the scheduler to decide again."""
    await _two_gpus(ledger)
    view = (await ledger.changes_since(None)).cursor
    fits = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [result] = await ledger.admit_many([_admission("a", fits, placement_view=view)])
    assert result.ok and result.outcome == "granted"

    # The grant itself changed the ledger: the same view no longer holds.
    still_free = _placed("b", SliceClaim("n1/nvidia1", whole=True))
    seq = await ledger.redis.get(ledger.key("changes-seq"))
    [stale] = await ledger.admit_many([_admission("b", still_free, placement_view=view)])
    assert not stale.ok and stale.reason == VIEW_CHANGED
    assert await ledger.get_job("b") is None and await ledger.pending_jobs() == []
    assert await ledger.get_lease("lease-b") is None
    assert await ledger.redis.get(ledger.key("changes-seq")) == seq

    current = (await ledger.changes_since(view)).cursor
    other_server = dataclasses.replace(current, server="another-process")
    fits_c = _placed("c", SliceClaim("n1/nvidia1", 1024, 10))
    [moved] = await ledger.admit_many([_admission("c", fits_c, placement_view=other_server)])
    assert not moved.ok and moved.reason == VIEW_CHANGED
    assert await ledger.get_job("c") is None
    fits_d = _placed("d", SliceClaim("n1/nvidia1", 1024, 10))
    now = (await ledger.changes_since(current)).cursor
    [taken] = await ledger.admit_many([_admission("d", fits_d, placement_view=now)])
    assert taken.outcome == "granted"
    assert await audit(ledger) == []


async def test_live_load_alone_leaves_a_kept_view_standing(ledger: Ledger) -> None:
    """A change of live load (a device's utilisation) is logged and moves the change sequence,
    but a placement on a view read before it is still taken: nothing but telemetry changed. A
    capacity change after it withdraws that view as before; so does another epoch of the log."""
    await _two_gpus(ledger)
    view = (await ledger.changes_since(None)).cursor
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia1", util_pct=87.0)])).ok
    moved = (await ledger.changes_since(view)).cursor
    assert moved.seq > view.seq  # logged, for readers that score by it
    fits = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [granted] = await ledger.admit_many([_admission("a", fits, placement_view=view)])
    assert granted.ok and granted.outcome == "granted"

    # The grant is a capacity change: a view from before it is stale, load or not.
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia1", util_pct=12.0)])).ok
    late = _placed("b", SliceClaim("n1/nvidia1", 1024, 10))
    [stale] = await ledger.admit_many([_admission("b", late, placement_view=moved)])
    assert not stale.ok and stale.reason == VIEW_CHANGED
    other_log = dataclasses.replace((await ledger.changes_since(moved)).cursor, epoch="0.0")
    [rewound] = await ledger.admit_many([_admission("b", late, placement_view=other_log)])
    assert not rewound.ok and rewound.reason == VIEW_CHANGED
    current = (await ledger.changes_since(moved)).cursor
    [taken] = await ledger.admit_many([_admission("b", late, placement_view=current)])
    assert taken.outcome == "granted"
    assert await audit(ledger) == []


async def test_a_ledger_without_capacity_seq_counts_every_change(ledger: Ledger) -> None:
    """A ledger written before ``capacity-seq`` existed (or that lost the key) cannot tell live
    load from capacity: any change since the view withdraws it, as before the key."""
    await _two_gpus(ledger)
    view = (await ledger.changes_since(None)).cursor
    await ledger.redis.delete(ledger.key("capacity-seq"))
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia1", util_pct=87.0)])).ok
    fits = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [stale] = await ledger.admit_many([_admission("a", fits, placement_view=view)])
    assert not stale.ok and stale.reason == VIEW_CHANGED
    current = (await ledger.changes_since(view)).cursor
    [taken] = await ledger.admit_many([_admission("a", fits, placement_view=current)])
    assert taken.outcome == "granted"


async def test_no_job_overtakes_one_that_waits(ledger: Ledger) -> None:
    """With a job in the pending queue, a new placed job waits behind it even though its
    placement fits: the queue's order (priorities, fair share) is the cycle's to decide."""
    await _two_gpus(ledger)
    assert (await ledger.pend("waiting", 500, b"{}", None, "insufficient_capacity")).ok
    await asyncio.sleep(0.01)  # arrival order is kept to the millisecond
    fits = _placed("late", SliceClaim("n1/nvidia1", whole=True))
    [result] = await ledger.admit_many([_admission("late", fits)])
    assert result.ok and result.outcome == "pending" and result.reason == "jobs_waiting"
    assert [job.job_id for _, job in await ledger.pending_jobs()] == ["waiting", "late"]
    assert await audit(ledger) == []


async def test_a_batch_is_decided_in_order_each_atomically(ledger: Ledger) -> None:
    """Sent together: the first takes the device; the second's placement on the same device is
    refused, so it waits; the third, though its placement fits, waits behind the second."""
    await _two_gpus(ledger)
    results = await ledger.admit_many(
        [
            _admission("a", _placed("a", SliceClaim("n1/nvidia0", whole=True))),
            _admission("b", _placed("b", SliceClaim("n1/nvidia0", whole=True))),
            _admission("c", _placed("c", SliceClaim("n1/nvidia1", whole=True))),
        ]
    )
    assert [r.outcome for r in results] == ["granted", "pending", "pending"]
    assert [job.job_id for _, job in await ledger.pending_jobs()] == ["b", "c"]
    assert await audit(ledger) == []


async def test_admission_rules_hold_for_a_placed_job(ledger: Ledger) -> None:
    """Rate limit, duplicates and quota still apply: an over-rate job is refused with nothing
    taken, a duplicate of a granted job is not granted twice, and a placement over its queue's
    limit waits instead of exceeding it."""
    await _two_gpus(ledger)
    limits = AdmissionLimits(rate_per_s=1.0, burst=1)
    first = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [granted] = await ledger.admit_many([_admission("a", first, limits=limits)])
    assert granted.outcome == "granted"
    over = _placed("b", SliceClaim("n1/nvidia1", whole=True))
    [refused] = await ledger.admit_many([_admission("b", over, limits=limits)])
    assert not refused.ok and refused.reason == "rate_limited"
    assert await ledger.get_lease("lease-b") is None

    again = _placed("a", SliceClaim("n1/nvidia1", whole=True), lease_id="lease-a2")
    [duplicate] = await ledger.admit_many([_admission("a", again)])
    assert not duplicate.ok and duplicate.reason == "job_leased"
    assert await ledger.get_lease("lease-a2") is None

    capped = _placed(
        "c",
        SliceClaim("n1/nvidia1", whole=True),
        usage=[UsageClaim("q", "units", 1.0, limit=0.5)],
    )
    [waits] = await ledger.admit_many([_admission("c", capped)])
    assert waits.ok and waits.outcome == "pending" and waits.reason == "quota_exceeded"
    assert await ledger.usage("q") == {}
    assert await audit(ledger) == []


async def test_a_placement_for_another_job_or_tenant_is_refused_before_any_write(
    ledger: Ledger,
) -> None:
    """The placement must be the admitted job's own, for its own tenant."""
    await _two_gpus(ledger)
    foreign = _placed("other", SliceClaim("n1/nvidia0", whole=True))
    [refused] = await ledger.admit_many([_admission("mine", foreign)])
    assert not refused.ok and refused.reason == "placement_mismatch"
    wrong_tenant = _placed("mine", SliceClaim("n1/nvidia0", whole=True), tenant="u")
    [refused] = await ledger.admit_many([_admission("mine", wrong_tenant)])
    assert not refused.ok and refused.reason == "placement_mismatch"
    assert await ledger.get_job("mine") is None
    assert await ledger.get_lease("lease-other") is None


async def test_admissions_carry_the_change_log_read_right_after_them(ledger: Ledger) -> None:
    """``admit_and_read``: the admissions answered as ``admit_many`` answers them, and in the
    same round trip the change log as it was once they were committed: their own changes in it,
    the same read a ``changes_since`` right after gives."""
    await _two_gpus(ledger)
    before = await ledger.changes_since(None)
    placement = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    results, changes = await ledger.admit_and_read(
        [_admission("a", placement), _admission("b")], before.cursor, 256
    )
    assert [r.outcome for r in results] == ["granted", "pending"]
    assert changes is not None and changes.complete
    assert changes.cursor.seq == results[0].change_seq
    assert "lease-a" in changes.leases and "n1/nvidia0" in changes.devices
    again = await ledger.changes_since(before.cursor, 256)
    assert (again.cursor, again.leases, again.devices) == (
        changes.cursor,
        changes.leases,
        changes.devices,
    )
    assert again.records == changes.records
    assert await audit(ledger) == []


async def test_admissions_with_a_read_are_sent_again_once_the_scripts_are_loaded(
    ledger: Ledger,
) -> None:
    """A server that lost its scripts (restarted, cache flushed) refuses every call of the
    round trip with NOSCRIPT, so none ran: they are loaded and sent again, and each admission
    happens once."""
    await _two_gpus(ledger)
    before = await ledger.changes_since(None)
    await ledger.redis.script_flush()
    placement = _placed("a", SliceClaim("n1/nvidia0", whole=True))
    [result], changes = await ledger.admit_and_read(
        [_admission("a", placement)], before.cursor, 256
    )
    assert result.outcome == "granted" and changes is not None and "lease-a" in changes.leases
    [again] = await ledger.admit_many([_admission("a", placement)])
    assert not again.ok and again.reason == "job_leased"
    assert await audit(ledger) == []


async def test_the_three_ways_to_an_active_lease_leave_the_same_ledger(ledger: Ledger) -> None:
    """A lease granted on arrival (``pend.lua``), granted at once by a cycle (``reserve.lua``
    with a secret) and reserved then granted (``reserve.lua``, then ``grant.lua``) end in the
    same records: the first two write the lease once, already active, and must write what the
    third writes in two steps. Only ids, clocks and the fencing token's value may differ."""
    result = await ledger.register_node(
        "n1", [device_spec("n1", i) for i in range(3)], 64_000, 256_000
    )
    assert result.ok
    trace = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1",
    }
    secret = new_lease_secret()
    meta = SliceMeta("nvidia", "A100", 0, "GPU-same", True)

    def placement(job: str, device: int, with_secret: bool) -> Reservation:
        return reservation(
            job,
            SliceClaim(f"n1/nvidia{device}", 1000, 10, meta=meta),
            host={"n1": HostClaim(500, 2048)},
            usage=[UsageClaim("q", "units", 0.1), UsageClaim("q", "dev:A100", 0.1)],
            max_runtime_ms=90_000,
            idle_after_ms=30_000,
            secret=secret if with_secret else "",
        )

    [arrived] = await ledger.admit_many([_admission("a", placement("a", 0, True), trace=trace)])
    assert arrived.outcome == "granted"
    for job in ("b", "c"):
        [waiting] = await ledger.admit_many([_admission(job, trace=trace)])
        assert waiting.outcome == "pending"
    assert (await ledger.reserve(placement("b", 1, True))).ok
    assert (await ledger.reserve(placement("c", 2, False))).ok
    assert (await ledger.grant("lease-c", secret)).ok

    async def records(job: str, device: int) -> dict[str, Any]:
        """The job's lease, job record, index entries and grant event, ids and clocks taken
        out (times as offsets from the grant)."""
        redis, lease_id = ledger.redis, f"lease-{job}"

        def same(value: Any) -> str:
            text = _s(value).replace(lease_id, "LEASE").replace(f"nvidia{device}", "DEV")
            return "JOB" if text == job else text

        def record(raw: Any) -> dict[str, str]:
            return {_s(k): same(v) for k, v in raw.items()}

        lease = record(await redis.hgetall(ledger.key("lease", lease_id)))
        granted = int(lease.pop("granted_ms"))
        assert int(lease.pop("created_ms")) <= granted and int(lease.pop("token")) > 0
        clocks = {f: int(lease.pop(f)) - granted for f in ("expires_ms", "deadline_ms")}
        found = record(await redis.hgetall(ledger.key("job", job)))
        found.pop("since_ms")
        # The request's fingerprint: each job's request names its own job id.
        assert len(found.pop("digest")) == 16
        indexes = {}
        for name in ("expiry", "deadlines", "idle-watch"):
            score = await redis.zscore(ledger.key(name), lease_id)
            indexes[name] = None if score is None else score - granted
        outboxes: Any = [
            await redis.xrange(ledger.key("outbox", name)) for name in ("direct", "lease-manager")
        ]
        events = [
            record(fields) | {"id": _s(entry_id)}
            for entries in outboxes
            for entry_id, fields in entries
        ]
        events = [e for e in events if e["lease_id"] == "LEASE"]
        # Each lease keeps its grant's entry (the lease-manager asks whether it is still there
        # before it publishes a later event) and names the outbox that holds it unless that is
        # the direct one: the one difference the three ways leave.
        assert lease.pop("grant_entry") == events[0]["id"]
        assert lease.pop("grant_outbox", None) == (None if job == "a" else "lease-manager")
        for event in events:
            event.pop("id")
            event["expires_ms"] = str(int(event["expires_ms"]) - granted)
        return {
            "lease": lease,
            "clocks": clocks,
            "job": found,
            "indexes": indexes,
            "in leases": await redis.sismember(ledger.key("leases"), lease_id),
            "on its device": await redis.sismember(
                ledger.key("dev-leases", f"n1/nvidia{device}"), lease_id
            ),
            "on its node": await redis.sismember(ledger.key("node-leases", "n1"), lease_id),
            "events": events,
        }

    arrived_lease = await records("a", 0)
    assert arrived_lease == await records("b", 1)
    assert arrived_lease == await records("c", 2)
    assert arrived_lease["lease"]["state"] == "active" and arrived_lease["job"]["state"] == "leased"
    assert [e["kind"] for e in arrived_lease["events"]] == ["granted"]
    assert arrived_lease["indexes"] == {"expiry": 60_000, "deadlines": 90_000, "idle-watch": 30_000}
    assert await audit(ledger) == []
