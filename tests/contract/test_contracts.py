"""Contract tests: payloads round-trip, the registry is complete, proto/ matches the code."""

from __future__ import annotations

import enum
import json
import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import yaml

from xpupool.contracts import asyncapi, decoder_for, describe_error, encode, encode_finite
from xpupool.contracts import payloads as p
from xpupool.contracts.subjects import CHANNELS, STREAMS, channel_of, subject_of

PROTO = Path(__file__).resolve().parents[2] / "proto"
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
SLICE = p.DeviceSlice(
    device_id="n1/nvidia0",
    node_id="n1",
    vendor=p.Vendor.NVIDIA,
    model="A100-80GB",
    index=0,
    uuid="GPU-1",
    memory_mib=81920,
    compute_pct=100,
    whole=True,
)
SPEC = p.DeviceSpec(
    device_id="n1/nvidia0",
    vendor=p.Vendor.NVIDIA,
    model="A100-80GB",
    index=0,
    uuid="GPU-1",
    memory_mib=81920,
)
MIG_SPEC = p.DeviceSpec(
    device_id="n1/nvidia1/mig1.0",
    vendor=p.Vendor.NVIDIA,
    model="A100-80GB",
    index=1,
    uuid="MIG-5c4f",
    memory_mib=40960,
    isolation=["mig"],
    parent_uuid="GPU-2",
    partition=p.PartitionSpec(kind="mig", profile="3g.40gb", gpu_slices=3, compute_slices=3),
)
GRANT = p.AllocationGranted(
    job_id="j1",
    lease_id="l1",
    tenant="t",
    owner="o",
    fencing_token=7,
    granted_at=NOW,
    expires_at=NOW,
    slices=[SLICE],
    env={"CUDA_VISIBLE_DEVICES": "GPU-1"},
    host=[p.HostShare(node_id="n1", cpu_milli=4000, memory_mib=8192)],
    lease_secret="secret",
)

EXAMPLES: list[msgspec.Struct] = [
    p.JobRequested(
        job_id="j1",
        tenant="t",
        count=2,
        device=p.DeviceDemand(memory_mib=1024, compute_pct=10),
        selector=p.DeviceSelector(vendor=p.Vendor.ASCEND, models=["910B"]),
        gang=p.GangSpec(same_domain=True),
        labels={"team": "nlp"},
    ),
    p.JobRejected(job_id="j1", tenant="t", field_name="count", reason=p.JobReason.INVALID_REQUEST),
    p.JobPending(job_id="j1", tenant="t", reason=p.JobReason.INSUFFICIENT_CAPACITY, since=NOW),
    p.JobTimedOut(job_id="j1", tenant="t", waited_s=3.5),
    p.JobCancelled(job_id="j1", tenant="t", waited_s=1.5),
    p.LeaseEnding(
        job_id="j1",
        lease_id="l1",
        tenant="t",
        reason=p.EndReason.MAX_RUNTIME,
        deadline=NOW,
        fencing_token=7,
    ),
    p.CancelJob(job_id="j1"),
    p.ListJobs(limit=10),
    p.JobList(
        ok=True,
        jobs=[
            p.JobInfo(
                job_id="j1",
                state=p.JobState.PENDING,
                reason=p.JobReason.INSUFFICIENT_CAPACITY,
                since=NOW,
            )
        ],
    ),
    p.GetLease(lease_id="l1"),
    p.ListLeases(),
    p.LeaseList(
        ok=True,
        leases=[
            p.LeaseInfo(
                lease_id="l1",
                job_id="j1",
                state=p.LeaseState.ACTIVE,
                fencing_token=7,
                slices=[SLICE],
                host=[p.HostShare(node_id="n1", cpu_milli=1000)],
                granted_at=NOW,
                expires_at=NOW,
            )
        ],
    ),
    p.LeaseList(ok=False, error=p.QueryError.UNKNOWN_LEASE),
    p.CancelReply(ok=True, job_id="j1", outcome=p.CancelOutcome.CANCELLED),
    p.CancelReply(ok=False, job_id="j1", error=p.CancelError.JOB_ENDED, detail="it timed out"),
    p.SubmitReply(job_id="j1", outcome=p.SubmitOutcome.WAITING),
    p.SubmitReply(
        job_id="j1",
        outcome=p.SubmitOutcome.REJECTED,
        rejected=p.JobRejected(job_id="j1", tenant="t", reason=p.JobReason.RATE_LIMITED),
    ),
    p.SubmitReply(
        job_id="j1",
        outcome=p.SubmitOutcome.GRANTED,
        granted=GRANT,
    ),
    p.JobReserved(
        job_id="j1",
        lease_id="l1",
        tenant="t",
        owner="o",
        queue="q",
        priority=500,
        lease_ttl_s=60,
        slices=[SLICE],
    ),
    p.EndLease(lease_id="l1", reason=p.EndReason.PREEMPTED, grace_s=30),
    GRANT,
    p.LeaseRenewed(job_id="j1", lease_id="l1", fencing_token=7, expires_at=NOW),
    p.LeaseEnded(
        job_id="j1",
        lease_id="l1",
        tenant="t",
        reason=p.EndReason.EXPIRED,
        fencing_token=7,
        ended_at=NOW,
    ),
    p.RenewLease(lease_id="l1", lease_secret="s", fencing_token=7, ttl_s=30),
    p.ReleaseLease(lease_id="l1", lease_secret="s", fencing_token=7),
    p.LeaseReply(ok=True, lease_id="l1", expires_at=NOW),
    p.LeaseReply(ok=False, lease_id="l1", error=p.LeaseError.NOT_OWNER),
    p.NodeRegistered(node_id="n1", devices=[SPEC, MIG_SPEC], cpu_milli=1000),
    p.NodeHeartbeat(node_id="n1", at=NOW, device_count=1),
    p.NodeLost(node_id="n1", last_seen=NOW),
    p.TelemetrySampled(node_id="n1", at=NOW, samples=[p.DeviceSample(device_id="n1/nvidia0")]),
    p.DeviceHealthChanged(
        node_id="n1",
        device_id="n1/nvidia0",
        previous=p.Health.HEALTHY,
        current=p.Health.UNHEALTHY,
        reason="xid 79",
        at=NOW,
    ),
    p.InjectFault(node_id="n1", device_id="n1/nvidia0", fault="xid"),
    p.LeaseOverused(
        node_id="n1",
        device_id="n1/nvidia0",
        lease_id="l1",
        job_id="j1",
        granted_memory_mib=1024,
        used_memory_mib=2048,
        at=NOW,
    ),
    p.ScaleDecision(
        decision_id="d1",
        pool="a100",
        action=p.ScaleAction.SCALE_UP,
        reason=p.ScaleReason.PENDING_DEMAND,
        count=2,
        size_before=1,
        size_after=3,
        demand=p.ScaleDemand(job_ids=["j1", "j2"], jobs=2, devices=16, capacity_units=16.0),
        cost_per_hour_delta=28.8,
        request_id="r1",
        at=NOW,
    ),
    p.NodeProvisioning(
        request_id="r1",
        decision_id="d1",
        pool="a100",
        provider="simulated",
        count=2,
        job_ids=["j1", "j2"],
        expected_ready_at=NOW,
        at=NOW,
    ),
    p.NodeReady(pool="a100", node_id="a100-1", request_id="r1", provisioned_s=180.0, at=NOW),
    p.NodeDraining(
        pool="a100",
        node_id="a100-1",
        decision_id="d2",
        policy=p.DrainPolicy.PREEMPT,
        grace_s=60.0,
        leases=1,
        at=NOW,
    ),
    p.NodeRemoved(pool="a100", node_id="a100-1", decision_id="d3", request_id="r2", at=NOW),
    p.ScaleFailed(
        pool="a100", request_id="r3", action=p.ScaleAction.SCALE_UP, error="quota", at=NOW
    ),
]


def test_every_channel_payload_has_an_example() -> None:
    """Each payload type on the registry is covered by the round-trip examples below."""
    covered = {type(e) for e in EXAMPLES}
    for channel in CHANNELS:
        for t in (*channel.payloads, *([channel.reply] if channel.reply else [])):
            assert t in covered, t.__name__


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_payload_round_trips(event: msgspec.Struct) -> None:
    """Encoding then decoding any payload gives it back unchanged, tag included."""
    data = encode(event)
    assert json.loads(data)["type"] == type(event).__struct_config__.tag
    assert decoder_for((type(event),)).decode(data) == event


@pytest.mark.parametrize("event", EXAMPLES, ids=lambda e: type(e).__name__)
def test_payload_validates_against_published_schema(event: msgspec.Struct) -> None:
    """What the services send validates against the schema file a foreign client reads."""
    schema = json.loads((PROTO / "schemas" / f"{type(event).__name__}.json").read_text())
    jsonschema.validate(json.loads(encode(event)), schema)


def test_every_event_type_maps_to_one_subject() -> None:
    """channel_of/subject_of resolve every payload, filling subject parameters."""
    for event in EXAMPLES:
        replies = p.LeaseReply | p.CancelReply | p.SubmitReply | p.JobList | p.LeaseList
        if isinstance(event, replies):
            continue
        subject = subject_of(event)
        assert "{" not in subject
        assert subject.startswith("xpupool.")
        assert channel_of(event).address.split(".")[:3] == subject.split(".")[:3]


def test_stream_subjects_do_not_overlap_and_cover_stream_channels() -> None:
    """A JetStream channel's subject is captured by exactly its own stream."""
    import fnmatch

    def captured(subject: str, pattern: str) -> bool:
        return fnmatch.fnmatch(subject, pattern.replace(">", "*"))

    for channel in CHANNELS:
        concrete = (
            channel.address.replace("{reason}", "released")
            .replace("{node_id}", "n1")
            .replace("{tenant}", "acme")
        )
        owners = [s.name for s in STREAMS if any(captured(concrete, x) for x in s.subjects)]
        expected = [channel.stream.name] if channel.stream else []
        assert owners == expected, channel.address


def test_old_minimal_request_stays_valid() -> None:
    """The smallest request upstream systems send (no type tag, two fields) still decodes."""
    request = decoder_for((p.JobRequested,)).decode(b'{"job_id":"a","tenant":"b"}')
    assert request.count == 1 and request.device.is_whole


def test_host_only_request_decodes_with_count_zero() -> None:
    """``count: 0`` (a host-only job) is a valid request; a negative count names the field."""
    decoder = decoder_for((p.JobRequested,))
    request = decoder.decode(b'{"job_id":"a","tenant":"b","count":0,"host":{"cpu_milli":500}}')
    assert request.count == 0 and request.host.cpu_milli == 500
    with pytest.raises(msgspec.ValidationError) as bad:
        decoder.decode(b'{"job_id":"a","tenant":"b","count":-1}')
    assert describe_error(bad.value)[0] == "count"
    schema = json.loads((PROTO / "schemas" / "JobRequested.json").read_text())
    jsonschema.validate(json.loads(encode(request)), schema)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('"count":0,"host":{"cpu_milli":500},"device":{"compute_pct":10}', "device.compute_pct"),
        ('"count":0,"host":{"cpu_milli":500},"device":{"memory_mib":10}', "device.memory_mib"),
        ('"count":0,"host":{"cpu_milli":500},"gang":{}', "gang"),
        ('"count":0,"host":{"cpu_milli":500},"selector":{"vendor":"nvidia"}', "selector.vendor"),
        ('"count":0', "host"),
        ('"count":0,"host":{"cpu_milli":0,"memory_mib":0}', "host"),
    ],
)
def test_invalid_host_only_requests_are_rejected_naming_the_field(body: str, field: str) -> None:
    """What a foreign client sends as a malformed host-only request is rejected by the
    scheduler's validation (``invalid_request``) with the field to blame, never a crash."""
    from xpupool.scheduler.domain import Reason, default_config
    from xpupool.scheduler.domain.matching import validate_request

    raw = ('{"job_id":"a","tenant":"b",' + body + "}").encode()
    request = decoder_for((p.JobRequested,)).decode(raw)
    rejection = validate_request(request, default_config())
    assert rejection is not None
    assert (rejection.reason, rejection.field) == (Reason.INVALID_REQUEST, field)


def test_committed_proto_matches_the_code() -> None:
    """proto/ is generated: `just proto` must be re-run after a payload or subject change."""
    for relative, text in asyncapi.render().items():
        path = PROTO / relative
        assert path.exists(), f"{relative} missing: run `just proto`"
        assert path.read_text() == text, f"{relative} drifted from the code: run `just proto`"
    committed = {f"schemas/{f.name}" for f in (PROTO / "schemas").glob("*.json")}
    assert committed <= set(asyncapi.render()), "stale schema files: run `just proto`"


def test_rejections_without_a_job_id_are_not_deduplicated_together() -> None:
    """Two unrelated malformed requests (no job id) must not share a JetStream dedup id."""
    from xpupool.contracts.subjects import dedup_id

    invalid = p.JobReason.INVALID_REQUEST
    assert dedup_id(p.JobRejected(job_id="", reason=invalid)) is None
    first = dedup_id(p.JobRejected(job_id="j1", reason=invalid, field_name="count"))
    assert first == dedup_id(p.JobRejected(job_id="j1", reason=invalid, field_name="count"))
    # A second, different rejection of the same job id is a different event, not a duplicate.
    second = dedup_id(p.JobRejected(job_id="j1", reason=invalid, field_name="priority"))
    assert first and second and first != second and first.startswith("j1:rejected:")


CLIENT_SENT = (
    p.JobRequested,
    p.RenewLease,
    p.ReleaseLease,
    p.CancelJob,
    p.ListJobs,
    p.GetLease,
    p.ListLeases,
)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"job_id":"a","device":{"compute_percent":30}}', "device.compute_percent"),
        ('{"job_id":"a","colour":"red"}', "colour"),
        ('{"job_id":"a","selector":{"vendors":"nvidia"}}', "selector.vendors"),
        ('{"job_id":"a","priority":"urgent"}', "priority"),
        ('{"job_id":"a","intent":"' + "x" * 100_000 + '"}', "intent"),
        ('{"job_id":"a","selector":{"models":["' + "m" * 1000 + '"]}}', "selector.models[0]"),
        ('{"job_id":"a","labels":{"k":"' + "v" * 5000 + '"}}', "labels"),
        ('{"job_id":"a","max_wait_s":1e308}', "max_wait_s"),
        ('{"job_id":"a","lease_ttl_s":5e-324}', "lease_ttl_s"),
        ('{"job_id":"a","count":100000000000000000000000}', "count"),
        ('{"job_id":"a","tenant":"a.b"}', "tenant"),
    ],
)
def test_client_input_is_strict_and_bounded(body: str, field: str) -> None:
    """Unknown fields, closed vocabularies, oversized strings and extreme numbers in what clients
    send are refused naming the field, and the detail never echoes an oversized value."""
    with pytest.raises(msgspec.ValidationError) as bad:
        decoder_for((p.JobRequested,)).decode(body.encode())
    named, detail = describe_error(bad.value)
    assert named is not None and named.startswith(field.split("[")[0]), (named, detail)
    assert len(detail) <= 512


def test_client_sent_schemas_forbid_unknown_fields_and_service_messages_do_not() -> None:
    """Strict where clients write (a typo is an error), lenient between services (rolling
    upgrades): the published schemas say which is which."""
    for t in CLIENT_SENT:
        schema = json.loads((PROTO / "schemas" / f"{t.__name__}.json").read_text())
        assert schema["additionalProperties"] is False, t.__name__
    for lenient in (p.JobReserved, p.NodeRegistered, p.AllocationGranted):
        schema = json.loads((PROTO / "schemas" / f"{lenient.__name__}.json").read_text())
        assert schema.get("additionalProperties", True) is not False, lenient.__name__
        later = encode(EXAMPLES_BY_TYPE[lenient])[:-1] + b',"added_later":1}'
        decoder_for((lenient,)).decode(later)


EXAMPLES_BY_TYPE = {type(e): e for e in EXAMPLES}


def test_operator_copies_never_carry_the_lease_secret() -> None:
    """A grant goes to its owner's subject with the secret and to the operator subject without."""
    from xpupool.contracts.subjects import deliveries

    grant = EXAMPLES_BY_TYPE[p.AllocationGranted]
    assert isinstance(grant, p.AllocationGranted) and grant.lease_secret
    routed = {subject: event for _, subject, event in deliveries(grant)}
    assert set(routed) == {"xpupool.alloc.v1.granted", "xpupool.tenant.v1.t.events.granted"}
    assert routed["xpupool.tenant.v1.t.events.granted"].lease_secret == "secret"  # type: ignore[attr-defined]
    assert routed["xpupool.alloc.v1.granted"].lease_secret is None  # type: ignore[attr-defined]
    # The owner's copy goes first: it is the one a job waits on.
    assert list(routed) == ["xpupool.tenant.v1.t.events.granted", "xpupool.alloc.v1.granted"]


def test_every_reason_and_error_code_is_an_enum_in_the_schema() -> None:
    """Codes a client switches on are closed vocabularies in the published contract."""
    for name, field in (
        ("JobRejected", "reason"),
        ("JobPending", "reason"),
        ("LeaseReply", "error"),
        ("LeaseEnded", "reason"),
        ("JobRequested", "priority"),
    ):
        schema = json.loads((PROTO / "schemas" / f"{name}.json").read_text())
        text = json.dumps(schema["properties"][field])
        assert "$ref" in text and "enum" not in text or "enum" in text, (name, field)
        ref = text.split("#/$defs/")[1].split('"')[0] if "$ref" in text else None
        assert ref is None or "enum" in schema["$defs"][ref], (name, field)


@pytest.mark.parametrize("errors", [p.LeaseError, p.CancelError, p.QueryError])
def test_the_bus_refusal_codes_are_values_of_every_reply_error(errors: type) -> None:
    """Services answer undecodable commands with ``Error(invalid.code)``: each code the bus can
    give must be a value of every reply's error enum."""
    from xpupool.bus import INVALID_REQUEST, PAYLOAD_TOO_LARGE

    for code in (INVALID_REQUEST, PAYLOAD_TOO_LARGE):
        assert errors(code).value == code


@pytest.mark.parametrize(
    ("request_fields", "path"),
    [
        ({"max_wait_s": math.inf}, "max_wait_s"),
        ({"lease_ttl_s": math.nan}, "lease_ttl_s"),
        # A percentage worked out by division in untyped code: Python puts a float in an int.
        ({"device": p.DeviceDemand(memory_pct=-math.inf)}, "device.memory_pct"),  # type: ignore[arg-type]
        ({"selector": p.DeviceSelector(min_capacity=math.nan)}, "selector.min_capacity"),
    ],
)
def test_a_number_json_cannot_carry_is_refused_naming_its_field(
    request_fields: dict[str, Any], path: str
) -> None:
    """msgspec writes NaN and infinity as ``null``: a client's ``max_wait_s=inf`` would reach the
    scheduler as "no limit", its ``lease_ttl_s=nan`` as a type error about a ``null``."""
    request = p.JobRequested(job_id="j", tenant="t", **request_fields)
    assert f'"{path.rsplit(".", 1)[-1]}":null'.encode() in encode(request)  # sent unchecked
    with pytest.raises(ValueError, match=rf"^{re.escape(path)} must be a finite number$"):
        encode_finite(request)
    finite = p.JobRequested(job_id="j", tenant="t", max_wait_s=5.0, labels={"a": "b"})
    assert encode_finite(finite) == encode(finite)


def test_what_fields_and_enum_members_mean_reaches_the_published_schemas() -> None:
    """The docstrings under fields and enum members (what ``known``, ``releasing`` or
    ``lease_not_granted`` mean, what ``max_runtime_s`` does) are part of the contract: msgspec
    publishes only class docstrings, so proto/ must carry them too."""
    docs = asyncapi._attribute_docs()
    assert "KNOWN" in docs["SubmitOutcome"] and "max_runtime_s" in docs["JobRequested"]
    assert "LEASE_NOT_GRANTED" in docs["LeaseError"] and "reason" in docs["JobInfo"]
    for name, members in docs.items():
        schema = json.loads((PROTO / "schemas" / f"{name}.json").read_text())
        kind = getattr(p, name)
        for member, text in members.items():
            if issubclass(kind, enum.Enum):
                value = getattr(kind, member).value
                assert f"`{value}`: {text}" in schema["description"], (name, member)
            else:
                assert text in schema["properties"][member]["description"], (name, member)


def test_the_published_request_rules_are_the_bus_s() -> None:
    """What proto/ tells a foreign client about requests is what the bus does: the size it reads
    (``payload_too_large`` beyond), and the headers of a reply with no body (a service error),
    which every request/reply operation lists as a possible answer."""
    from xpupool.bus.consumer import MAX_MESSAGE_BYTES, SERVICE_ERROR, SERVICE_ERROR_CODE
    from xpupool.contracts.subjects import MAX_REQUEST_BYTES, SERVICE_ERROR_HEADERS

    assert MAX_MESSAGE_BYTES == MAX_REQUEST_BYTES
    assert (SERVICE_ERROR, SERVICE_ERROR_CODE) == SERVICE_ERROR_HEADERS
    document = yaml.safe_load((PROTO / "asyncapi.yaml").read_text())
    assert document["x-xpupool-max-request-bytes"] == MAX_MESSAGE_BYTES
    assert f"over {MAX_MESSAGE_BYTES:,} bytes" in document["info"]["description"]
    error = document["components"]["messages"]["ServiceError"]
    assert error["headers"]["required"] == [SERVICE_ERROR, SERVICE_ERROR_CODE]
    assert "payload" not in error  # the body is empty
    replying = [o for o in document["operations"].values() if "reply" in o]
    assert len(replying) == sum(1 for c in CHANNELS if c.reply is not None)
    for operation in replying:
        refs = [m["$ref"] for m in operation["reply"]["messages"]]
        assert refs[-1] == "#/components/messages/ServiceError", operation["channel"]
        assert "_INBOX." in operation["reply"]["address"]["description"]


def test_events_without_a_fixed_id_are_the_ones_proto_calls_repeatable() -> None:
    """A foreign client deduplicates by ce-id: a tenant event whose ce-id is fresh on every
    publish (no ``dedup_id``) must be named in proto/ as one that may come again."""
    from xpupool.contracts.subjects import dedup_id

    tenant_types = {
        t for c in CHANNELS if c.tenant_scoped and c.receivers == ("upstream",) for t in c.payloads
    }
    events: list[msgspec.Struct] = [e for e in EXAMPLES if type(e) in tenant_types]
    events += [p.JobRejected(job_id="j1", tenant="t", reason=reason) for reason in p.JobReason]
    assert {type(e) for e in events} == tenant_types
    fresh = {
        f"`{e.reason.value}` JobRejected" if isinstance(e, p.JobRejected) else type(e).__name__
        for e in events
        if dedup_id(e) is None
    }
    assert fresh, "every tenant event has a fixed id: say so in DELIVERY"
    document = yaml.safe_load((PROTO / "asyncapi.yaml").read_text())
    for label in fresh:
        assert f"a {label} " in document["info"]["description"].replace("A ", "a "), label


def test_a_requests_fingerprint_leaves_defaults_out_so_an_added_field_keeps_it() -> None:
    """The ledger fingerprints a request by the scheduler's encoding of it (``pend.lua``: a
    retry is the same request, another under the same job id is refused). Fields at their
    defaults are left out, so a later version that adds a field with a default encodes an
    earlier request the same, and a retry across the upgrade is still a retry. (Defaults the
    sender wrote out are left out too where they decode to the default itself: enumerations,
    small integers, empty collections; a float such as ``lease_ttl_s: 300`` stays, msgspec
    comparing a float with its default by identity, and every retry of that JSON has it.)"""
    wire = json.dumps(
        {
            "job_id": "train-1",
            "tenant": "t",
            "device": {"memory_mib": 1000, "compute_pct": None},
            "priority": "normal",
            "count": 1,
            "labels": {},
        }
    )
    fingerprinted = msgspec.json.encode(
        msgspec.json.decode(wire, type=p.JobRequested), order="deterministic"
    )
    assert json.loads(fingerprinted) == {
        "type": "xpupool.job.requested.v1",
        "job_id": "train-1",
        "tenant": "t",
        "device": {"memory_mib": 1000},
        "selector": {},
        "host": {},
    }
    later_device = msgspec.defstruct(
        "DeviceDemand",
        [("new_limit", int | None, None)],
        bases=(p.DeviceDemand,),
        frozen=True,
        kw_only=True,
        omit_defaults=True,
    )
    later = msgspec.defstruct(
        "JobRequested",
        [
            ("new_option", str, "default"),
            ("device", later_device, msgspec.field(default_factory=later_device)),
        ],
        bases=(p.JobRequested,),
        frozen=True,
        kw_only=True,
        omit_defaults=True,
        tag_field="type",
        tag="xpupool.job.requested.v1",
    )
    upgraded = msgspec.json.encode(msgspec.json.decode(wire, type=later), order="deterministic")
    assert upgraded == fingerprinted
