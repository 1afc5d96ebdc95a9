"""Running plain async handlers on NATS messages.

One adapter does what every handler would otherwise repeat: decode into the channel's payload
type, open a ``process`` span under the sender's trace, bind log context, call the handler,
publish what it returns, and only then acknowledge. Handlers never see NATS.

Bad input is answered, never dropped: a payload that does not decode goes to the channel's
``on_invalid`` function, whose events (a rejection naming the field) are published before the
message is acknowledged. A handler that keeps failing gets ``on_give_up`` on its last delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from xpupool.bus.envelope import read_envelope
from xpupool.bus.publisher import Publisher
from xpupool.contracts import decoder_for, describe_error
from xpupool.contracts.subjects import Channel, Durable
from xpupool.obs import bind_message_context, get_logger

Handler = Callable[[Any], Awaitable[Sequence[msgspec.Struct]]]
InvalidHandler = Callable[[bytes, str | None, str], Sequence[msgspec.Struct]]
GiveUpHandler = Callable[[Any, BaseException], Sequence[msgspec.Struct]]

CONTEXT_FIELDS = ("job_id", "lease_id", "device_id", "node_id", "tenant")


def _context_of(event: Any) -> dict[str, Any]:
    return {name: getattr(event, name, None) for name in CONTEXT_FIELDS}


class _Dispatcher:
    """Decode, trace, log, call, publish: shared by stream consumers and subject servers."""

    def __init__(
        self,
        channel: Channel,
        handler: Handler,
        publisher: Publisher,
        on_invalid: InvalidHandler | None,
    ) -> None:
        self.channel = channel
        self.handler = handler
        self.publisher = publisher
        self.on_invalid = on_invalid
        self.decoder = decoder_for(channel.payloads)
        self.tracer = trace.get_tracer("xpupool.bus")
        self.log = get_logger()

    def span(self, msg: Msg) -> Any:
        """A CONSUMER span whose parent is the sender's trace (one trace per job)."""
        parent = propagate.extract(msg.headers or {})
        return self.tracer.start_as_current_span(
            f"process {self.channel.address}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.name": "process",
                "messaging.operation.type": "process",
                "messaging.destination.name": msg.subject,
            },
        )

    async def dispatch(self, msg: Msg, attempt: int) -> Sequence[msgspec.Struct] | None:
        """Run the handler on one message and publish its results.

        Returns the results, or None when the payload was invalid (already answered).
        Exceptions from the handler propagate to the caller, which decides on redelivery.
        """
        envelope = read_envelope(msg.headers)
        try:
            event = self.decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            field, reason = describe_error(error)
            bind_message_context(subject=msg.subject, event_id=envelope.id if envelope else None)
            self.log.warning("message_invalid", field=field, reason=reason, attempt=attempt)
            rejection = self.on_invalid(msg.data, field, reason) if self.on_invalid else []
            await self._publish_or_reply(msg, rejection)
            return None
        bind_message_context(
            subject=msg.subject,
            event_type=type(event).__name__,
            event_id=envelope.id if envelope else None,
            **_context_of(event),
        )
        started = time.perf_counter()
        results = await self.handler(event)
        await self._publish_or_reply(msg, results)
        self.log.info(
            "message_handled",
            outcome="ok",
            results=[type(r).__name__ for r in results],
            duration_s=round(time.perf_counter() - started, 6),
            attempt=attempt,
        )
        return results

    async def _publish_or_reply(self, msg: Msg, results: Sequence[msgspec.Struct]) -> None:
        reply_type = self.channel.reply
        for result in results:
            if reply_type is not None and isinstance(result, reply_type):
                if msg.reply:
                    await msg.respond(msgspec.json.encode(result))
            else:
                await self.publisher.publish(result)


async def consume_stream(
    js: JetStreamContext,
    durable: Durable,
    handler: Handler,
    publisher: Publisher,
    stop: asyncio.Event,
    *,
    on_invalid: InvalidHandler | None = None,
    on_give_up: GiveUpHandler | None = None,
    batch: int = 32,
    max_deliver: int = 5,
    ack_wait_s: float = 30.0,
    max_ack_pending: int = 1024,
) -> None:
    """Pull the messages of ``durable``'s channel from its stream until ``stop`` is set.

    Several replicas passing the same ``durable`` share the work. The pull subscription is
    re-created after any error other than an idle fetch, since nats-py's pull subscriptions do not
    survive a server restart on their own (nats.py #504).
    """
    channel, stream = durable.channel, durable.stream
    dispatcher = _Dispatcher(channel, handler, publisher, on_invalid)
    log = get_logger().bind(durable=durable.name, stream=stream.name)
    config = ConsumerConfig(
        durable_name=durable.name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        filter_subject=channel.pattern,
    )
    subscription: Any = None
    try:
        while not stop.is_set():
            try:
                if subscription is None:
                    subscription = await js.pull_subscribe(
                        config.filter_subject or channel.address,
                        durable=durable.name,
                        stream=stream.name,
                        config=config,
                    )
                messages = await subscription.fetch(batch, timeout=0.5)
            except (nats.errors.TimeoutError, TimeoutError):
                continue  # an idle fetch, not a fault
            except Exception as error:  # noqa: BLE001  (any transport failure: rebuild and retry)
                log.warning("consumer_restarting", error=repr(error))
                subscription = None
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                await _process_stream_message(msg, dispatcher, max_deliver, on_give_up, log)
    finally:
        # A pull subscription left open keeps nc.drain() waiting for its full timeout.
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()


async def _process_stream_message(
    msg: Msg,
    dispatcher: _Dispatcher,
    max_deliver: int,
    on_give_up: GiveUpHandler | None,
    log: Any,
) -> None:
    attempt = msg.metadata.num_delivered if msg.metadata else 1
    with dispatcher.span(msg) as span:
        try:
            await dispatcher.dispatch(msg, attempt)
            await msg.ack_sync()
        except Exception as error:  # noqa: BLE001  (the handler's failure is data, not a crash)
            span.set_status(Status(StatusCode.ERROR, repr(error)))
            span.set_attribute("error.type", type(error).__name__)
            if attempt >= max_deliver:
                await _give_up(msg, dispatcher, on_give_up, error, log, attempt)
            else:
                log.warning("message_failed", error=repr(error), attempt=attempt, will_retry=True)
                try:
                    await msg.nak(delay=min(0.2 * 2**attempt, 5.0))
                except Exception as nak_error:  # noqa: BLE001  (ack_wait redelivers anyway)
                    log.warning("nak_failed", error=repr(nak_error))


async def _give_up(
    msg: Msg,
    dispatcher: _Dispatcher,
    on_give_up: GiveUpHandler | None,
    error: BaseException,
    log: Any,
    attempt: int,
) -> None:
    log.error("message_failed", error=repr(error), attempt=attempt, will_retry=False)
    if on_give_up is None:
        await msg.term()
        return
    try:
        event = dispatcher.decoder.decode(msg.data)
        await dispatcher.publisher.publish_all(on_give_up(event, error))
        await msg.ack_sync()
    except Exception as final_error:  # noqa: BLE001  (leave it to JetStream's redelivery)
        log.error("give_up_failed", error=repr(final_error))


async def serve_subject(
    nc: Client,
    channel: Channel,
    handler: Handler,
    publisher: Publisher,
    queue: str,
    *,
    on_invalid: InvalidHandler | None = None,
) -> Any:
    """Serve a core-NATS subject in a queue group; results of the channel's reply type go back to
    the requester, everything else is published. Returns the subscription."""
    dispatcher = _Dispatcher(channel, handler, publisher, on_invalid)
    log = get_logger().bind(subject=channel.address, queue=queue)

    async def on_message(msg: Msg) -> None:
        with dispatcher.span(msg) as span:
            try:
                await dispatcher.dispatch(msg, attempt=1)
            except Exception as error:  # noqa: BLE001  (answer the caller, keep serving)
                span.set_status(Status(StatusCode.ERROR, repr(error)))
                log.error("request_failed", error=repr(error))
                if msg.reply:
                    await nc.publish(
                        msg.reply,
                        b"",
                        headers={
                            "Nats-Service-Error": repr(error)[:200],
                            "Nats-Service-Error-Code": "500",
                        },
                    )

    return await nc.subscribe(channel.pattern, queue=queue, cb=on_message)
