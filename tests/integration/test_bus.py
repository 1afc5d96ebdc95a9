"""The bus adapter on a real nats-server: envelope, ack-after-publish, bad input, give-up."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry.sdk.trace import TracerProvider

from tests.conftest import eventually
from xpupool.bus import InvalidMessage, Publisher, consume_stream
from xpupool.contracts import JobReason, JobRejected, JobRequested, subjects
from xpupool.devstack.readiness import pulling, wait_until_pulling
from xpupool.devstack.servers import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _durable(name: str) -> subjects.Durable:
    """A test's own durable on the job requests (so tests do not share one)."""
    return subjects.Durable(name, subjects.JOB_REQUESTED, "tests")


async def _received(nc: Client, subject: str) -> list[Msg]:
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=keep)
    return seen


async def _pending_in_jobs_stream(nc: Client) -> int:
    info = await nc.jetstream().stream_info(subjects.JOBS_STREAM.name)
    return int(info.state.messages)


async def test_handler_results_are_published_before_the_ack(nc: Client) -> None:
    """A handler's results go out with CloudEvents headers and trace context, and the request
    leaves the work queue only after that."""
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    publisher = Publisher(nc, source="/tests")
    rejections = await _received(nc, subjects.JOB_REJECTED.address)
    tenant_rejections = await _received(nc, subjects.TENANT_JOB_REJECTED.pattern)
    requests = await _received(nc, subjects.JOB_REQUESTED.pattern)
    stop = asyncio.Event()
    handled: list[tuple[JobRequested, str]] = []

    async def handler(request: JobRequested, *, tenant: str) -> Sequence[msgspec.Struct]:
        handled.append((request, tenant))
        return [JobRejected(job_id=request.job_id, tenant=tenant, reason=JobReason.INVALID_REQUEST)]

    with tracer.start_as_current_span("upstream"):
        await publisher.publish(JobRequested(job_id="b1", tenant="t"))
    task = asyncio.create_task(
        consume_stream(nc.jetstream(), _durable("test-jobs"), handler, publisher, stop)
    )
    await eventually(lambda: rejections)
    headers = requests[0].headers or {}
    assert headers["ce-type"] == "xpupool.job.requested.v1" and headers["ce-id"] == "b1"
    assert headers["Nats-Msg-Id"] == "b1" and headers["traceparent"].startswith("00-")
    assert requests[0].subject == "xpupool.tenant.v1.t.jobs.requested"
    assert (rejections[0].headers or {})["ce-id"].startswith("b1:rejected:")
    assert [(r.job_id, t) for r, t in handled] == [("b1", "t")]
    # The owner's copy goes to the tenant's own events, with the same event id.
    await eventually(lambda: tenant_rejections)
    assert tenant_rejections[0].subject == "xpupool.tenant.v1.t.events.rejected"
    tenant_headers, headers = tenant_rejections[0].headers or {}, rejections[0].headers or {}
    assert tenant_headers["ce-id"] == headers["ce-id"]

    async def acknowledged() -> bool:
        return await _pending_in_jobs_stream(nc) == 0

    await eventually(acknowledged)
    stop.set()
    await task
    provider.shutdown()


async def test_bad_input_is_answered_and_acknowledged(nc: Client) -> None:
    """A payload that does not decode gets the channel's rejection and is not redelivered."""
    publisher = Publisher(nc, source="/tests")
    rejections = await _received(nc, subjects.JOB_REJECTED.address)
    stop = asyncio.Event()
    calls: list[object] = []

    async def handler(request: JobRequested) -> Sequence[msgspec.Struct]:
        calls.append(request)
        return []

    def on_invalid(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
        return [
            JobRejected(
                job_id="?",
                field_name=invalid.field,
                reason=JobReason.INVALID_REQUEST,
                detail=invalid.detail,
            )
        ]

    subject = subjects.JOB_REQUESTED.subject(tenant="t")
    await nc.jetstream().publish(subject, b'{"job_id": 5, "tenant": "t"}')
    await nc.jetstream().publish(subject, b"not json at all")
    task = asyncio.create_task(
        consume_stream(
            nc.jetstream(),
            _durable("test-bad"),
            handler,
            publisher,
            stop,
            on_invalid=on_invalid,
        )
    )
    await eventually(lambda: len(rejections) == 2)
    fields = [msgspec.json.decode(m.data)["field_name"] for m in rejections]
    assert fields == ["job_id", None] and calls == []
    await asyncio.sleep(0.5)
    assert len(rejections) == 2 and await _pending_in_jobs_stream(nc) == 0
    stop.set()
    await task


async def test_a_handler_that_keeps_failing_ends_in_give_up(nc: Client) -> None:
    """A failing handler is retried, and on its last delivery the give-up events go out."""
    publisher = Publisher(nc, source="/tests")
    rejections = await _received(nc, subjects.JOB_REJECTED.address)
    stop = asyncio.Event()
    attempts: list[int] = []

    async def handler(request: JobRequested, *, tenant: str) -> Sequence[msgspec.Struct]:
        attempts.append(1)
        raise RuntimeError("ledger down")

    def give_up(request: JobRequested, error: BaseException) -> Sequence[msgspec.Struct]:
        return [
            JobRejected(job_id=request.job_id, reason=JobReason.INTERNAL_ERROR, detail=str(error))
        ]

    await publisher.publish(JobRequested(job_id="doomed", tenant="t"))
    task = asyncio.create_task(
        consume_stream(
            nc.jetstream(),
            _durable("test-fail"),
            handler,
            publisher,
            stop,
            on_give_up=give_up,
            max_deliver=3,
        )
    )
    await eventually(lambda: rejections, timeout_s=30)
    assert len(attempts) == 3
    assert msgspec.json.decode(rejections[0].data)["detail"] == "ledger down"
    stop.set()
    await task


async def test_readiness_waits_for_a_pulling_consumer(nc: Client, nats_server: NatsServer) -> None:
    """A durable nobody pulls is not ready (missing or idle); once a consumer loop runs it is."""
    durable = subjects.SCHEDULER_JOBS
    js = nc.jetstream()
    assert await pulling(js, [durable]) == [durable]  # not even created
    with pytest.raises(TimeoutError, match="scheduler-jobs"):
        await wait_until_pulling(nats_server.url, [durable], timeout_s=0.3)

    async def ignore(request: JobRequested, *, tenant: str) -> Sequence[msgspec.Struct]:
        return []

    stop = asyncio.Event()
    publisher = Publisher(nc, source="/tests")
    task = asyncio.create_task(consume_stream(js, durable, ignore, publisher, stop))
    await wait_until_pulling(nats_server.url, [durable], timeout_s=10)
    stop.set()
    await task


async def test_a_durable_made_with_other_delivery_limits_takes_the_service_s(
    nc: Client,
) -> None:
    """A durable an older release made (5 tries, as the bus's default was for every command)
    is updated to the limits the service now passes, in place: its unacknowledged message is
    still delivered, and redelivered past the old limit."""
    js = nc.jetstream()
    durable = _durable("test-limits")
    await js.add_consumer(
        subjects.JOBS_STREAM.name,
        config=ConsumerConfig(
            durable_name=durable.name,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=30.0,
            max_deliver=2,
            filter_subject=durable.channel.pattern,
        ),
    )
    publisher = Publisher(nc, source="/tests")
    await publisher.publish(JobRequested(job_id="limits-1", tenant="t"))
    attempts: list[str] = []

    async def fail_three_times(request: JobRequested, *, tenant: str) -> Sequence[msgspec.Struct]:
        attempts.append(request.job_id)
        if len(attempts) <= 3:
            raise RuntimeError("ledger away")
        return []

    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_stream(js, durable, fail_three_times, publisher, stop, max_deliver=10)
    )
    await eventually(lambda: len(attempts) >= 4, timeout_s=20)
    info = await js.consumer_info(subjects.JOBS_STREAM.name, durable.name)
    assert info.config.max_deliver == 10
    stop.set()
    await task
    assert attempts == ["limits-1"] * 4
