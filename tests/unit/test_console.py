"""The console's view models, from ledger records and payloads alone (no servers)."""

from __future__ import annotations

import io
from datetime import UTC, datetime

import msgspec
from rich.console import Console

from xpupool.cli.console import (
    NO_QUEUE,
    EventLine,
    Summary,
    event_line,
    event_subjects,
    events_table,
    matches,
    pending_queue,
    pool_summary,
    queue_summary,
    summary_json,
    summary_tables,
)
from xpupool.contracts import DeviceSpec, Health, Vendor
from xpupool.ledger.ledger import DeviceRecord, LeaseRecord, NodeRecord, TakenSlice


def _device(
    device_id: str,
    model: str = "A100-80GB",
    *,
    vendor: Vendor = Vendor.NVIDIA,
    free_mib: int = 81920,
    compute_free: int = 100,
    health: Health = Health.HEALTHY,
    util: float | None = None,
) -> DeviceRecord:
    spec = DeviceSpec(
        device_id=device_id, vendor=vendor, model=model, index=0, uuid=device_id, memory_mib=81920
    )
    return DeviceRecord(
        spec=spec,
        node_id="n",
        memory_total_mib=81920,
        memory_free_mib=free_mib,
        compute_free_pct=compute_free,
        holders=0 if compute_free == 100 else 1,
        exclusive=False,
        health=health,
        util_pct=util,
        memory_used_mib=None,
    )


def _node(node_id: str, devices: list[DeviceRecord], status: str = "ready") -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        status=status,
        cpu_total_milli=8000,
        cpu_free_milli=8000,
        memory_total_mib=65536,
        memory_free_mib=65536,
        last_seen_ms=0,
        labels={},
        devices=devices,
    )


def _lease(lease_id: str, queue: str, state: str, compute: list[int]) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lease_id,
        job_id=f"job-{lease_id}",
        tenant="t",
        owner="o",
        queue=queue,
        priority=0,
        state=state,
        slices=[
            TakenSlice(f"d{i}", "n", c == 100, 1024 * c // 10, c) for i, c in enumerate(compute)
        ],
        token=1,
        ttl_ms=1000,
        created_ms=0,
        granted_ms=None,
        expires_ms=0,
        end_reason=None,
        end_detail="",
        ended_ms=None,
    )


def test_pool_groups_by_vendor_and_model_and_sums_capacity() -> None:
    nodes = [
        _node("a", [_device("a0", free_mib=40960, compute_free=50, util=80.0), _device("a1")]),
        _node("b", [_device("b0", "910B", vendor=Vendor.ASCEND, health=Health.DEGRADED)]),
        # A lost node's devices are no capacity: not counted.
        _node("c", [_device("c0")], status="lost"),
    ]
    nvidia, ascend = sorted(pool_summary(nodes), key=lambda r: r.vendor != "nvidia")
    assert (nvidia.vendor, nvidia.model, nvidia.devices, nvidia.healthy) == (
        "nvidia",
        "A100-80GB",
        2,
        2,
    )
    assert nvidia.memory_total_mib == 2 * 81920 and nvidia.memory_used_mib == 40960
    assert nvidia.memory_free_mib == 81920 + 40960
    assert nvidia.compute_used_pct == 25.0 and nvidia.compute_free_pct == 75.0
    # Only the device that reported utilisation is averaged.
    assert nvidia.util_pct == 80.0
    assert (ascend.devices, ascend.healthy, ascend.unhealthy, ascend.util_pct) == (1, 0, 1, None)


def test_empty_pool_is_empty() -> None:
    assert pool_summary([]) == []
    assert queue_summary([], [], 0) == []


def test_queues_count_running_reserved_pending_and_pool_share() -> None:
    leases = [
        _lease("l1", "train", "active", [100, 100]),
        _lease("l2", "train", "reserved", [50]),
        _lease("l3", "", "active", [50]),
    ]
    usage = {"train": {"units": 2.5, "devices:A100-80GB": 2.5}, "idle": {"units": 0.0}}
    rows = {r.queue: r for r in queue_summary(leases, ["train", None, "infer"], 400, usage)}
    # A queue with only zero counters and nothing running or waiting is not listed.
    assert set(rows) == {"train", "infer", NO_QUEUE}
    assert rows["train"].quota_used == {"devices:A100-80GB": 2.5, "units": 2.5}
    assert rows["infer"].quota_used == {}
    train = rows["train"]
    assert (train.running, train.reserved, train.pending, train.devices_held) == (1, 1, 1, 3)
    assert train.compute_pct == 250 and train.pool_compute_share == 0.625
    assert (rows[NO_QUEUE].running, rows[NO_QUEUE].pending) == (1, 1)
    assert (rows["infer"].running, rows["infer"].pool_compute_share) == (0, 0.0)
    charged = queue_summary([], [], 100, {"batch": {"units": 1.0}})
    assert [(r.queue, r.running, r.quota_used) for r in charged] == [("batch", 0, {"units": 1.0})]


def test_pending_queue_reads_the_request_and_survives_a_bad_body() -> None:
    assert pending_queue(b'{"queue": "train", "job_id": "j"}') == "train"
    assert pending_queue(b'{"job_id": "j"}') is None
    assert pending_queue(b"not json") is None
    assert pending_queue(b"[1, 2]") is None


def test_event_line_of_a_grant() -> None:
    payload = {
        "type": "xpupool.alloc.granted.v1",
        "time": "2026-12-03T16:00:01.123456Z",
        "job_id": "j1",
        "lease_id": "lease-1",
        "tenant": "team-a",
        "slices": [{"node_id": "n1", "device_id": "n1-gpu0"}],
    }
    line = event_line("xpupool.alloc.v1.granted", msgspec.json.encode(payload))
    assert line == EventLine(
        time="2026-12-03T16:00:01",
        type="alloc.granted",
        tenant="team-a",
        job="j1",
        lease="lease-1",
        summary="on n1/n1-gpu0",
        subject="xpupool.alloc.v1.granted",
    )
    assert matches(line, "team-a", ["granted"]) and matches(line, None, ["alloc"])
    assert matches(line, None, ["alloc.granted"]) and matches(line, None, [])
    assert not matches(line, "team-b", []) and not matches(line, None, ["health"])


def test_event_line_summarises_reason_and_health() -> None:
    data = msgspec.json.encode(
        {"type": "xpupool.devices.health.v1", "device_id": "d0", "health": "unhealthy"}
    )
    line = event_line("xpupool.devices.v1.health", data, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert line.type == "devices.health" and line.time == "2026-01-02T03:04:05"
    assert line.summary == "device_id=d0 health=unhealthy" and line.tenant == ""


def test_a_bad_payload_is_shown_not_dropped() -> None:
    for data in (b"\xff\x00garbage", b'"a string"'):
        line = event_line("xpupool.alloc.v1.granted", data)
        assert line.type == "undecodable" and line.subject == "xpupool.alloc.v1.granted"
        assert line.summary == f"{len(data)} bytes"


def test_a_tenant_reads_only_its_own_subjects() -> None:
    assert event_subjects("team-a") == ["xpupool.tenant.v1.team-a.events.>"]
    operator = event_subjects(None)
    assert "xpupool.alloc.v1.>" in operator
    assert not any(".tenant." in x for x in operator)


def test_tables_render_the_rows() -> None:
    nodes = [_node("a", [_device("a0", compute_free=50)])]
    summary = Summary(
        pool_summary(nodes), queue_summary([_lease("l", "q", "active", [50])], [], 100)
    )
    out = io.StringIO()
    console = Console(file=out, width=160)
    console.print(summary_tables(summary))
    console.print(events_table([EventLine("t", "alloc.granted", "x", "j", "l", "s", "subj")]))
    text = out.getvalue()
    assert "A100-80GB" in text and "50%" in text and "alloc.granted" in text
    assert summary_json(summary)["queues"][0]["pool_compute_share"] == 0.5


def test_queues_show_the_published_fair_share_usage_and_its_fraction() -> None:
    leases = [_lease("l1", "train", "active", [100])]
    fair = {"train": 3.0, "infer": 1.0, "gone": 0.0}
    rows = {r.queue: r for r in queue_summary(leases, [], 400, None, fair, 4.0)}
    # A queue with decayed usage is listed even with nothing running; one with none is not.
    assert set(rows) == {"train", "infer"}
    assert (rows["train"].fair_share_usage, rows["train"].fair_share_fraction) == (3.0, 0.75)
    assert (rows["infer"].fair_share_usage, rows["infer"].fair_share_fraction) == (1.0, 0.25)
    # No scheduler published a view: unknown, not zero.
    (unknown,) = queue_summary(leases, [], 400)
    assert (unknown.fair_share_usage, unknown.fair_share_fraction) == (None, None)
