"""Span attributes name a message the same way on both ends, and a sender cannot make them big."""

from __future__ import annotations

from xpupool.bus.envelope import ATTRIBUTE_LIMIT, ce_headers, read_envelope
from xpupool.bus.semconv import consumer_attributes, producer_attributes
from xpupool.contracts import JobRequested, subjects


def test_producer_and_consumer_agree_on_the_message_identity() -> None:
    headers = ce_headers(JobRequested, "/svc/a b", "job:1")
    subject = "xpupool.tenant.v1.t.jobs.requested"
    template = subjects.JOB_REQUESTED.address
    sent = producer_attributes(template, subject, headers)
    received = consumer_attributes(template, subject, read_envelope(headers), 12)
    shared = (
        "messaging.system",
        "messaging.destination.name",
        "messaging.destination.template",
        "messaging.message.id",
        "cloudevents.event_id",
        "cloudevents.event_source",
        "cloudevents.event_type",
        "cloudevents.event_spec_version",
    )
    assert {k: sent[k] for k in shared} == {k: received[k] for k in shared}
    # Percent-encoding is the header's business: the attributes carry the id and source as sent.
    assert sent["messaging.message.id"] == "job:1"
    assert sent["cloudevents.event_source"] == "/svc/a b"
    assert (sent["messaging.operation.type"], received["messaging.operation.type"]) == (
        "send",
        "process",
    )
    assert received["messaging.message.body.size"] == 12


def test_received_attributes_are_bounded() -> None:
    huge = "x" * 100_000
    headers = {"ce-id": huge, "ce-source": huge, "ce-type": huge}
    attributes = consumer_attributes("t", "s" * 100_000, read_envelope(headers), 1)
    assert all(len(str(value)) <= ATTRIBUTE_LIMIT for value in attributes.values())


def test_a_message_without_envelope_has_no_cloudevents_attributes() -> None:
    attributes = consumer_attributes("t", "s", None, 0)
    assert attributes["messaging.system"] == "nats"
    assert not [k for k in attributes if k.startswith("cloudevents.")]
    assert "messaging.message.id" not in attributes
