"""One trace per job, as an operator's collector receives it: the services export over OTLP/HTTP
to a receiver inside the test, which decodes what they send with ``opentelemetry-proto``."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import pytest
from opentelemetry import context, propagate, trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.sdk.trace import TracerProvider

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.contracts import (
    AllocationGranted,
    JobRequested,
    SubmitOutcome,
    SubmitReply,
    subjects,
)
from xpupool.devstack.otlp import Received, Receiver, exporter_env, serve_receiver
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with serve_receiver() as received:
        yield received


# How the scheduler gets a job to its grant: placed on admission and granted in the admission
# script, the grant published by the scheduler itself; decided by a cycle and granted in the
# reservation's script; or reserved by a cycle and then granted by the lease-manager.
MODES = {
    "on-admission": {"XPUPOOL_PLACE_ON_ADMISSION": "1", "XPUPOOL_GRANT_AT_RESERVE": "1"},
    "in-cycle": {"XPUPOOL_PLACE_ON_ADMISSION": "0", "XPUPOOL_GRANT_AT_RESERVE": "1"},
    "two-step": {"XPUPOOL_PLACE_ON_ADMISSION": "0", "XPUPOOL_GRANT_AT_RESERVE": "0"},
}
GRANT_STEPS = {
    "on-admission": {"schedule admission", "publish granted"},
    "in-cycle": {"relay granted"},
    "two-step": {"relay reserved", "lease grant", "relay granted"},
}


def _traced_stack(
    make_stack: Callable[..., Stack], receiver: Receiver, mode: str = "on-admission"
) -> Stack:
    env = exporter_env(receiver) | MODES[mode]
    return make_stack([NodeSpec("node-a", "2xA100-80GB")], extra_env=env)


KIND_CONSUMER = SpanProto.SpanKind.SPAN_KIND_CONSUMER
KIND_PRODUCER = SpanProto.SpanKind.SPAN_KIND_PRODUCER
REQUESTED = f"process {subjects.JOB_REQUESTED.address}"
SUBMITTED = f"process {subjects.JOB_SUBMIT.address}"


@pytest.mark.parametrize("mode", list(MODES))
async def test_submit_grant_renew_release_is_one_trace(
    make_stack: Callable[..., Stack], ready: Ready, receiver: Receiver, mode: str
) -> None:
    stack = _traced_stack(make_stack, receiver, mode)
    await ready(stack, 2)
    trace_id, submitter = secrets.token_hex(16), secrets.token_hex(8)
    token = context.attach(propagate.extract({"traceparent": f"00-{trace_id}-{submitter}-01"}))
    try:
        async with stack.client() as client:
            # On the job stream: a request by request/reply would land on another subject
            # whenever the scheduler serves it before this runs (the client falls back to the
            # stream only when none answers), and these spans are the stream's.
            outcome = await client.submit_and_wait(
                JobRequested(job_id="tr-1", tenant="team-a"), by_request=False
            )
            assert isinstance(outcome, AllocationGranted), outcome
            assert (await client.renew(outcome.lease_id, outcome.fencing_token)).ok
            assert (await client.release(outcome.lease_id, outcome.fencing_token)).ok
    finally:
        context.detach(token)

    # The holder's renewal and release publish their own events (the direct outbox). Each
    # service exports its spans on its own schedule, so the wait names every service's steps: a
    # scheduler's spans may arrive after the lease-manager's later ones.
    lease_steps = {"lease release", "publish ended", "lease renew", "publish renewed"}
    steps = {REQUESTED, "schedule decision", *GRANT_STEPS[mode], *lease_steps}

    def received() -> set[str]:
        return {s.name for s in receiver.of_trace(trace_id)}

    with suppress(AssertionError):  # the assertion below names what is missing
        await eventually(lambda: steps <= received(), timeout_s=30)
    spans = receiver.of_trace(trace_id)
    names = {s.name for s in spans}
    assert steps <= names, steps - names
    assert {"scheduler", "lease-manager"} <= {s.service for s in spans}

    # Connected: every parent is in the trace, except those of the messages the client sent,
    # whose parent is the submitter's span (a client without an SDK adds no spans of its own).
    ids = {s.span_id for s in spans}
    outside = [s for s in spans if s.parent_id not in ids]
    assert outside and all(s.parent_id for s in spans), "a span of the job started a new trace"
    assert all(s.kind == KIND_CONSUMER for s in outside), [s.name for s in outside]
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        assert {s.parent_id for s in outside} == {submitter}

    # A scheduling cycle serves many jobs: its own trace, linking this job's. A job placed on
    # admission (alone in its batch here) is decided there, in its own trace, and no cycle.
    cycles = [s for s in receiver.spans if s.name == "schedule cycle" and trace_id in s.links]
    if mode == "on-admission":
        assert not cycles
        [batch] = receiver.named(trace_id, "schedule admission")
        assert batch.service == "scheduler" and batch.attributes["xpupool.arrivals"] == 1
    else:
        assert cycles and all(c.trace_id != trace_id for c in cycles)

    [admission] = receiver.named(trace_id, REQUESTED)
    assert admission.kind == KIND_CONSUMER and admission.service == "scheduler"
    expected = {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": "xpupool.tenant.v1.team-a.jobs.requested",
        "messaging.message.id": "tr-1",
        "cloudevents.event_id": "tr-1",
        "cloudevents.event_type": "xpupool.job.requested.v1",
    }
    assert {k: admission.attributes.get(k) for k in expected} == expected
    sends = [s for s in spans if s.kind == KIND_PRODUCER]
    assert sends and all(s.name.startswith("send ") for s in sends)
    for send in sends:
        assert send.attributes["messaging.system"] == "nats"
        assert send.attributes["messaging.operation.type"] == "send"
        assert send.attributes["messaging.message.id"] == send.attributes["cloudevents.event_id"]
        assert send.attributes["cloudevents.event_source"]

    [decision] = receiver.named(trace_id, "schedule decision")
    assert decision.attributes["xpupool.job_id"] == "tr-1"
    assert decision.attributes["xpupool.tenant"] == "team-a"
    assert decision.attributes["xpupool.outcome"] == "reserve"
    decided_in = "admission" if mode == "on-admission" else "cycle"
    assert decision.attributes["xpupool.decided_in"] == decided_in
    assert decision.attributes["xpupool.lease_id"] == outcome.lease_id
    assert decision.attributes["xpupool.device_model"] == outcome.slices[0].model
    assert "xpupool.queue" in decision.attributes
    # The ledger's Redis calls are client spans of the job trace, and never carry a secret.
    redis = [s for s in spans if s.attributes.get("db.system") == "redis"]
    assert {"scheduler", "lease-manager"} <= {s.service for s in redis}
    secret = outcome.lease_secret
    assert secret
    assert all(secret not in str(v) for s in receiver.spans for v in s.attributes.values())
    [lifetime] = receiver.named(trace_id, "lease lifetime")
    assert lifetime.attributes["xpupool.lease_id"] == outcome.lease_id
    assert lifetime.attributes["xpupool.reason"] == "released"
    assert lifetime.attributes["xpupool.tenant"] == "team-a"
    [renew] = receiver.named(trace_id, "lease renew")
    assert renew.service == "lease-manager"
    assert renew.attributes["xpupool.lease_id"] == outcome.lease_id
    assert renew.attributes["xpupool.outcome"] == "renewed"
    # The holder's commands published their events themselves, under their own spans: the
    # relay published neither.
    by_id = {s.span_id: s for s in spans}
    for command, published, subject in (
        ("lease renew", "publish renewed", "xpupool.alloc.v1.renewed"),
        ("lease release", "publish ended", "xpupool.alloc.v1.ended.released"),
    ):
        [span] = receiver.named(trace_id, published)
        assert by_id[span.parent_id].name == command
        assert subject in {
            s.attributes.get("messaging.destination.name")
            for s in spans
            if s.kind == KIND_PRODUCER and s.parent_id == span.span_id
        }
    assert not receiver.named(trace_id, "relay ended")
    assert not receiver.named(trace_id, "relay renewed")


async def test_a_job_without_trace_context_gets_a_root(
    make_stack: Callable[..., Stack], ready: Ready, receiver: Receiver
) -> None:
    stack = _traced_stack(make_stack, receiver)
    await ready(stack, 2)
    async with stack.client() as client:
        outcome = await client.submit_and_wait(
            JobRequested(job_id="tr-2", tenant="team-a"), by_request=False
        )
        assert isinstance(outcome, AllocationGranted), outcome

    def admission() -> list[Received]:
        return [
            s
            for s in receiver.spans
            if s.name == REQUESTED and s.attributes.get("messaging.message.id") == "tr-2"
        ]

    await eventually(admission, timeout_s=30)
    [root] = admission()
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        assert root.parent_id == ""  # the client had no trace: the admission starts one
    await eventually(lambda: receiver.named(root.trace_id, "publish granted"), timeout_s=30)
    names = {s.name for s in receiver.of_trace(root.trace_id)}
    assert {"schedule decision", *GRANT_STEPS["on-admission"]} <= names, names


async def test_a_job_submitted_by_request_is_one_trace(
    make_stack: Callable[..., Stack], ready: Ready, receiver: Receiver
) -> None:
    """The request/reply path (``jobs.submit``, what the client uses by default): the request's
    own process span, the admission, decision and grant under it, and the lease's steps after,
    all in the submitter's trace."""
    stack = _traced_stack(make_stack, receiver)
    await ready(stack, 2)
    trace_id, submitter = secrets.token_hex(16), secrets.token_hex(8)
    token = context.attach(propagate.extract({"traceparent": f"00-{trace_id}-{submitter}-01"}))
    request = JobRequested(job_id="tr-3", tenant="team-a")
    try:
        async with stack.client() as client:
            # Until the scheduler serves the subject a request finds no responder and admits
            # nothing (sending it again is safe in any case: the ledger deduplicates by job id).
            replies: list[SubmitReply] = []

            async def answered() -> bool:
                reply = await client.submit_request(request)
                replies.extend([reply] if reply is not None else [])
                return reply is not None

            await eventually(answered, timeout_s=30)
            [reply] = replies
            assert reply.outcome == SubmitOutcome.GRANTED and reply.granted is not None, reply
            grant = reply.granted
            assert (await client.release(grant.lease_id, grant.fencing_token)).ok
    finally:
        context.detach(token)

    steps = [SUBMITTED, "schedule decision", "publish granted", "lease release", "publish ended"]
    await eventually(lambda: all(receiver.named(trace_id, n) for n in steps), timeout_s=30)
    spans = receiver.of_trace(trace_id)
    assert not receiver.named(trace_id, REQUESTED), "the request went by the job stream"
    ids = {s.span_id for s in spans}
    outside = [s for s in spans if s.parent_id not in ids]
    assert outside and all(s.kind == KIND_CONSUMER for s in outside), [s.name for s in outside]
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        assert {s.parent_id for s in outside} == {submitter}

    [submitted] = receiver.named(trace_id, SUBMITTED)
    assert submitted.kind == KIND_CONSUMER and submitted.service == "scheduler"
    expected = {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": "xpupool.tenant.v1.team-a.jobs.submit",
        "messaging.message.id": "tr-3",
        "cloudevents.event_type": "xpupool.job.requested.v1",
    }
    assert {k: submitted.attributes.get(k) for k in expected} == expected
    # The admission batch and the decision hang under the request's span, not a trace of
    # their own, and the grant's events are sent in the same trace.
    [batch] = receiver.named(trace_id, "schedule admission")
    [decision] = receiver.named(trace_id, "schedule decision")
    assert batch.attributes["xpupool.arrivals"] == 1
    assert decision.attributes["xpupool.decided_in"] == "admission"
    assert decision.attributes["xpupool.lease_id"] == grant.lease_id
    sent = {
        s.attributes.get("messaging.destination.name") for s in spans if s.kind == KIND_PRODUCER
    }
    assert "xpupool.tenant.v1.team-a.events.granted" in sent, sent
    [lifetime] = receiver.named(trace_id, "lease lifetime")
    assert lifetime.attributes["xpupool.reason"] == "released"
