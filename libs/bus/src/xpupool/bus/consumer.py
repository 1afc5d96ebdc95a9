"""Running plain async handlers on NATS messages.

One adapter does what every handler would otherwise repeat: decode into the channel's payload
type, open a ``process`` span under the sender's trace, bind log context, call the handler,
publish what it returns, and only then acknowledge. Handlers never see NATS.

Bad input is answered, never dropped and never retried: a message over the size limit, one on a
tenant channel whose subject names no valid tenant, or a payload that does not decode (including
one nested too deep for the decoder) goes to the channel's ``on_invalid`` function as an
``InvalidMessage``, whose events (a rejection naming the field) are published before the message
is acknowledged. A handler that keeps failing gets ``on_give_up`` on its last delivery.

Nothing a sender writes can make a service send more than the server accepts (which would close
its connection for good): replies carry the service's own headers, never the request's, and an
event or reply over ``max_payload`` is not sent (``MessageTooLarge``; a reply is replaced by a
short error, see ``serve_subject``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from xpupool.bus.connection import round_trip
from xpupool.bus.envelope import MSG_ID_HEADER, Envelope, ce_headers, read_envelope
from xpupool.bus.lifecycle import BusClosed
from xpupool.bus.publisher import MessageTooLarge, Publisher, encoded_size
from xpupool.bus.semconv import consumer_attributes
from xpupool.contracts import decoder_for, describe_error, encode
from xpupool.contracts.access import INBOX_PREFIX
from xpupool.contracts.codec import DETAIL_LIMIT, FIELD_LIMIT, clip
from xpupool.contracts.subjects import (
    MAX_REQUEST_BYTES,
    SERVICE_ERROR_HEADERS,
    Channel,
    Durable,
)
from xpupool.obs import bind_message_context, get_logger, start_current_span

INVALID_REQUEST: Final = "invalid_request"
PAYLOAD_TOO_LARGE: Final = "payload_too_large"
MAX_MESSAGE_BYTES: Final = MAX_REQUEST_BYTES
"""Default size limit of a received payload; a bigger one is answered, never decoded (the limit
proto/ publishes)."""

ACK_PREFIX: Final = "$JS.ACK."
SERVICE_ERROR, SERVICE_ERROR_CODE = SERVICE_ERROR_HEADERS
PULL_EXPIRES_S: Final = 1.0
# How long past a pull request's expiry its 408 may take to arrive before the request is taken
# for lost (a reconnect in between loses it on the server).
PULL_GRACE_S: Final = 1.0
# How often a waiting consumer looks at its stop event.
STOP_POLL_S: Final = 0.25
RESTART_DELAY_S: Final = 0.5

CONTEXT_FIELDS = ("job_id", "lease_id", "device_id", "node_id", "tenant")


@dataclass(frozen=True)
class InvalidMessage:
    """A message that was not handed to its handler, and why; ``on_invalid`` answers it.

    ``data`` is the payload, cut to the dispatcher's size limit when it was over it. ``code`` is
    ``invalid_request`` or ``payload_too_large``. ``detail`` is at most 512 characters and never
    quotes a long value back. ``params`` are the channel's ``{param}`` values taken from the
    subject (empty where the subject does not parse). ``msg_id`` is the sender's
    ``Nats-Msg-Id`` header (clipped), which clients set to the job id: the one way to tell a
    sender which request was refused when the payload is not even JSON.
    """

    subject: str
    data: bytes
    field: str | None
    code: str
    detail: str
    params: dict[str, str]
    msg_id: str = ""

    @property
    def explained(self) -> str:
        """``detail``, led by the offending field when one is to blame (``limit: ...``)."""
        return f"{self.field}: {self.detail}" if self.field else self.detail


def _msg_id(msg: Msg) -> str:
    return clip((msg.headers or {}).get(MSG_ID_HEADER, ""), 128)


Handler = Callable[..., Awaitable[Sequence[msgspec.Struct]]]
"""``handler(event)``, or ``handler(event, tenant=...)`` on a tenant-scoped channel."""
InvalidHandler = Callable[[InvalidMessage], Sequence[msgspec.Struct]]
GiveUpHandler = Callable[[Any, BaseException], Sequence[msgspec.Struct]]
TooLargeReply = Callable[[msgspec.Struct], msgspec.Struct | None]
"""Given a reply too large to send, a short one to send instead (None: the header-only error)."""


@dataclass
class DispatchStats:
    """What a dispatcher did with its messages; a plain object, read by whoever holds it.

    Pass one to ``consume_stream``/``serve_subject`` (several may share one), or read
    ``dispatcher.stats``.
    """

    handled: int = 0
    failed: int = 0
    invalid: dict[str, int] = field(default_factory=dict)
    too_large: int = 0
    """Results (events or replies) that were not sent because they exceeded ``max_payload``."""
    reply_refused: int = 0
    """Requests handled but not answered: their reply subject was no inbox (``reply_inbox``)."""

    @property
    def invalid_total(self) -> int:
        """Invalid messages of every code."""
        return sum(self.invalid.values())

    def count_invalid(self, code: str) -> None:
        """One more invalid message of ``code``."""
        self.invalid[code] = self.invalid.get(code, 0) + 1


def _context_of(event: Any) -> dict[str, Any]:
    return {name: getattr(event, name, None) for name in CONTEXT_FIELDS}


def is_stream_message(msg: Msg) -> bool:
    """Whether a message on a pull inbox is a stream message (it carries its ack subject); the
    rest are the server's status messages, whatever their headers look like."""
    return bool(msg.reply) and msg.reply.startswith(ACK_PREFIX)


def reply_inbox(msg: Msg) -> str | None:
    """Where a request may be answered: its reply subject, when that is an inbox.

    The requester names the reply subject, and NATS checks only the subject a client publishes
    on, never the reply subject it sets: answered anywhere, a tenant's request would have the
    service publish with the service's rights, onto another tenant's events or a JetStream API
    subject (a stream purge takes any body). Every NATS client's inboxes are under ``_INBOX.``
    (on the secure stack ``_INBOX.t.<tenant>`` and ``_INBOX.svc.<role>``)."""
    reply = msg.reply
    return reply if reply and reply.startswith(INBOX_PREFIX) else None


class EarlyReply:
    """The reply to the request a handler serves (``serve_subject``), for a handler that knows
    its answer before it returns, such as one whose work is batched with other requests': sent
    at most once, and the dispatcher then sends no reply of its own."""

    def __init__(self, send: Callable[[msgspec.Struct], Awaitable[None]]) -> None:
        self._send = send
        self.sent = False

    async def send(self, reply: msgspec.Struct) -> None:
        if not self.sent:
            self.sent = True
            await self._send(reply)


# Set by the dispatcher around one handler call (each served request runs in its own task).
_EARLY_REPLY: contextvars.ContextVar[EarlyReply | None] = contextvars.ContextVar(
    "xpupool_early_reply", default=None
)


def early_reply() -> EarlyReply | None:
    """The reply of the request the calling handler serves, or None (a stream message, or a
    message sent without a reply subject)."""
    return _EARLY_REPLY.get()


# Set around one stream message's handler: "<stream>:<sequence>", the message's place in its
# stream, the same on every delivery of it.
_DELIVERED: contextvars.ContextVar[str] = contextvars.ContextVar("xpupool_delivered", default="")


def delivered_message() -> str:
    """The stream message the calling handler serves, as ``<stream>:<sequence>`` ('' for a core
    NATS message): a redelivery (its acknowledgement lost) has the same, a resubmission of the
    same content another, so a handler can tell the two apart."""
    return _DELIVERED.get()


def _service_error(description: str, code: str) -> dict[str, str]:
    return {SERVICE_ERROR: description, SERVICE_ERROR_CODE: code}


class _Dispatcher:
    """Decode, trace, log, call, publish: shared by stream consumers and subject servers."""

    def __init__(
        self,
        channel: Channel,
        handler: Handler,
        publisher: Publisher,
        on_invalid: InvalidHandler | None,
        *,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        stats: DispatchStats | None = None,
        reply_nc: Client | None = None,
        too_large_reply: TooLargeReply | None = None,
    ) -> None:
        self.channel = channel
        self.handler = handler
        self.publisher = publisher
        self.on_invalid = on_invalid
        self.max_message_bytes = max_message_bytes
        self.stats = stats if stats is not None else DispatchStats()
        # Replies go out only where there is a requester (core NATS); a stream message's reply
        # subject is its ack subject.
        self.reply_nc = reply_nc
        self.too_large_reply = too_large_reply
        self.decoder = decoder_for(channel.payloads)
        self.tenant_scoped = channel.tenant_scoped
        self.tracer = trace.get_tracer("xpupool.bus")
        self.log = get_logger()

    def span(self, msg: Msg) -> Any:
        """A CONSUMER span whose parent is the sender's trace (one trace per job)."""
        headers = msg.headers or {}
        parent = propagate.extract(headers)
        return start_current_span(
            self.tracer,
            f"process {self.channel.address}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=lambda: consumer_attributes(
                self.channel.address, msg.subject, read_envelope(headers), len(msg.data)
            ),
        )

    def decode(self, msg: Msg) -> tuple[Any, dict[str, str]] | InvalidMessage:
        """The message's event and subject parameters, or why it is invalid."""
        params = self.channel.params_of(msg.subject)
        size = len(msg.data)
        if size > self.max_message_bytes:
            return InvalidMessage(
                subject=msg.subject,
                data=msg.data[: self.max_message_bytes],
                field=None,
                code=PAYLOAD_TOO_LARGE,
                detail=f"{size} bytes, limit {self.max_message_bytes}",
                params=params or {},
                msg_id=_msg_id(msg),
            )
        if params is None and self.tenant_scoped:
            return self._invalid(msg, "tenant", "the subject names no valid tenant", {})
        try:
            event = self.decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            field_name, detail = describe_error(error)
        except RecursionError:
            field_name, detail = None, "nesting too deep"
        except Exception as error:  # noqa: BLE001  (whatever the decoder raises, the input is bad)
            field_name, detail = None, f"undecodable ({type(error).__name__})"
        else:
            return event, params or {}
        return self._invalid(msg, field_name, detail, params or {})

    @staticmethod
    def _invalid(
        msg: Msg, field_name: str | None, detail: str, params: dict[str, str]
    ) -> InvalidMessage:
        return InvalidMessage(
            subject=msg.subject,
            data=msg.data,
            field=field_name,
            code=INVALID_REQUEST,
            detail=clip(detail, DETAIL_LIMIT),
            params=params,
            msg_id=_msg_id(msg),
        )

    async def dispatch(self, msg: Msg, attempt: int) -> Sequence[msgspec.Struct] | None:
        """Run the handler on one message and publish its results.

        Returns the results, or None when the message was invalid (already answered).
        Exceptions from the handler propagate to the caller, which decides on redelivery.
        """
        envelope = read_envelope(msg.headers)
        decoded = self.decode(msg)
        if isinstance(decoded, InvalidMessage):
            await self._answer_invalid(msg, decoded, envelope, attempt)
            return None
        event, params = decoded
        context = _context_of(event)
        if self.tenant_scoped:
            context["tenant"] = params["tenant"]
        bind_message_context(
            subject=msg.subject,
            event_type=type(event).__name__,
            event_id=envelope.id if envelope else None,
            **context,
        )
        started = time.perf_counter()
        early = None
        inbox = self._inbox(msg)
        if self.reply_nc is not None and inbox and self.channel.reply is not None:
            early = EarlyReply(functools.partial(self._reply, self.reply_nc, inbox))
        token = _EARLY_REPLY.set(early)
        try:
            if self.tenant_scoped:
                results = await self.handler(event, tenant=params["tenant"])
            else:
                results = await self.handler(event)
        finally:
            _EARLY_REPLY.reset(token)
        await self._send(msg, results, replied=early is not None and early.sent)
        self.stats.handled += 1
        self.log.info(
            "message_handled",
            outcome="ok",
            results=[type(r).__name__ for r in results],
            duration_s=round(time.perf_counter() - started, 6),
            attempt=attempt,
        )
        return results

    async def _answer_invalid(
        self, msg: Msg, invalid: InvalidMessage, envelope: Envelope | None, attempt: int
    ) -> None:
        self.stats.count_invalid(invalid.code)
        bind_message_context(
            subject=msg.subject,
            event_id=envelope.id if envelope else None,
            tenant=invalid.params.get("tenant"),
        )
        self.log.warning(
            "message_invalid",
            code=invalid.code,
            field=invalid.field,
            reason=invalid.detail,
            size=len(msg.data),
            attempt=attempt,
            invalid_total=self.stats.invalid_total,
        )
        answer = self.on_invalid(invalid) if self.on_invalid else []
        try:
            await self._send(msg, answer)
        except MessageTooLarge as error:
            # The input stays invalid however often it is delivered: log it, never retry it.
            self.log.error("invalid_answer_not_sent", error=str(error))

    async def _send(
        self, msg: Msg, results: Sequence[msgspec.Struct], *, replied: bool = False
    ) -> None:
        reply_type = self.channel.reply
        for result in results:
            if reply_type is not None and isinstance(result, reply_type):
                inbox = reply_inbox(msg)
                if self.reply_nc is not None and inbox and not replied:
                    await self._reply(self.reply_nc, inbox, result)
                continue
            try:
                await self.publisher.publish(result)
            except MessageTooLarge:
                self.stats.too_large += 1
                raise

    def _inbox(self, msg: Msg) -> str | None:
        """``reply_inbox``, saying so once per request whose reply subject is no inbox: it is
        handled (its events go out as they would), but not answered there."""
        inbox = reply_inbox(msg)
        if msg.reply and inbox is None and self.reply_nc is not None:
            self.stats.reply_refused += 1
            self.log.warning("reply_refused", reply=clip(msg.reply, FIELD_LIMIT))
        return inbox

    def _reply_headers(self, reply: msgspec.Struct) -> dict[str, str]:
        try:
            headers = ce_headers(type(reply), self.publisher.source)
        except (TypeError, AttributeError):  # a reply type without a CloudEvents type tag
            headers = {"content-type": "application/json"}
        propagate.inject(headers)
        return headers

    async def _reply(self, nc: Client, inbox: str, reply: msgspec.Struct) -> None:
        """Answer a request with the service's own headers (never the request's: nats-py's
        ``Msg.respond`` copies those back), and never more than the server accepts."""
        data, headers = encode(reply), self._reply_headers(reply)
        size = encoded_size(data, headers)
        if size <= nc.max_payload:
            await nc.publish(inbox, data, headers=headers)
            return
        self.stats.too_large += 1
        self.log.error(
            "reply_too_large",
            reply_type=type(reply).__name__,
            size=size,
            limit=nc.max_payload,
        )
        short = self.too_large_reply(reply) if self.too_large_reply else None
        if short is not None:
            data, headers = encode(short), self._reply_headers(short)
            if encoded_size(data, headers) <= nc.max_payload:
                await nc.publish(inbox, data, headers=headers)
                return
        await nc.publish(inbox, b"", headers=_service_error("response too large", "500"))


# ---- JetStream: a durable pull consumer ------------------------------------------------------


class PullStatusError(Exception):
    """The server ended a pull request with a status other than "no messages" or "expired"
    (409 consumer deleted or leadership change, 503 no responders, ...)."""

    def __init__(self, status: str | None, description: str | None) -> None:
        super().__init__(f"pull request ended with status {status} {description or ''}".strip())
        self.status = status


def _limits(config: ConsumerConfig) -> tuple[int | None, int | None, int | None]:
    """A durable's delivery limits that a server updates in place: tries, acknowledgement wait
    (whole milliseconds: the server keeps nanoseconds, the client seconds), pending acks."""
    ack_wait_ms = None if config.ack_wait is None else round(config.ack_wait * 1000)
    return config.max_deliver, ack_wait_ms, config.max_ack_pending


class _PullConsumer:
    """One durable's pull requests, answered on an inbox of its own.

    nats-py's ``fetch`` takes any message whose headers carry a status line for a server status,
    and a client may publish a message with exactly such headers into a stream; it would never
    be handled. Here a message is a stream message iff its reply subject is an ack subject
    (``$JS.ACK.…``), which the server sets on every stream message and on no status message.
    """

    def __init__(self, js: JetStreamContext, durable: Durable, config: ConsumerConfig) -> None:
        self.js = js
        self.nc: Client = js._nc
        self.durable = durable
        self.config = config
        prefix = getattr(js, "_prefix", None) or "$JS.API"
        self.next_subject = f"{prefix}.CONSUMER.MSG.NEXT.{durable.stream.name}.{durable.name}"
        self.sub: Subscription | None = None

    async def open(self) -> Subscription:
        """Create the durable if it is missing, bring an existing one's delivery limits to this
        service's, and subscribe to a fresh inbox.

        The server stops delivering a message after its durable's ``max_deliver``, whatever the
        service would still try: a durable made by an older release (a lower limit, another
        acknowledgement wait) would drop a command the service now retries for longer. Only the
        fields a server lets a durable change are compared, so a running durable is updated in
        place and keeps its position."""
        if self.sub is None:
            stream = self.durable.stream.name
            try:
                info = await self.js.consumer_info(stream, self.durable.name)
            except NotFoundError:
                await self.js.add_consumer(stream, config=self.config)
            else:
                if _limits(info.config) != _limits(self.config):
                    await self.js.add_consumer(stream, config=self.config)
            self.sub = await self.nc.subscribe(self.nc.new_inbox())
        return self.sub

    async def close(self) -> None:
        """Drop the inbox (a pull subscription left open keeps ``nc.drain()`` waiting)."""
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.unsubscribe(), timeout=1.0)

    async def pull(
        self,
        batch: int,
        expires_s: float,
        stop: asyncio.Event,
        process: Callable[[Msg], Awaitable[None]],
    ) -> None:
        """One pull request for up to ``batch`` messages; each is processed as it arrives.

        Ends when the batch is complete, when the server says there is nothing more (404) or the
        request expired (408), when ``stop`` is set, or when the request is presumed lost.
        """
        sub = await self.open()
        request = {"batch": batch, "expires": int(expires_s * 1_000_000_000)}
        await self.nc.publish(self.next_subject, json.dumps(request).encode(), reply=sub.subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + expires_s + PULL_GRACE_S
        received = 0
        while received < batch and not stop.is_set():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return  # no answer at all: lost in a reconnect; the next request replaces it
            try:
                msg = await sub.next_msg(timeout=min(remaining, STOP_POLL_S))
            except TimeoutError:
                continue
            if is_stream_message(msg):
                received += 1
                await process(msg)
                continue
            headers = msg.headers or {}
            status = headers.get("Status")
            if status == "100":
                continue  # an idle heartbeat
            if status in ("404", "408"):
                return  # nothing (more) to deliver, or the request expired
            raise PullStatusError(status, headers.get("Description"))


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
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    stats: DispatchStats | None = None,
    pull_expires_s: float = PULL_EXPIRES_S,
    concurrency: int = 1,
) -> None:
    """Pull the messages of ``durable``'s channel from its stream until ``stop`` is set.

    ``concurrency`` messages at most are handled at once (each acknowledged when its own handler
    is done, so in any order); 1 handles them one after the other, in stream order. A handler
    that batches its work (``xpupool.ledger.group_commit``) needs more than one to see a batch.

    Several replicas passing the same ``durable`` share the work. Each message is handled as it
    arrives; a pull request stays waiting on the server (its ``num_waiting`` is the readiness
    signal). After any transport error the inbox is dropped, the durable looked up (re-created
    if a server restart lost it) and pulling resumes. A connection closed for good raises
    ``BusClosed``: retrying on it would leave the service alive but deaf.
    """
    channel = durable.channel
    dispatcher = _Dispatcher(
        channel,
        handler,
        publisher,
        on_invalid,
        max_message_bytes=max_message_bytes,
        stats=stats,
    )
    log = get_logger().bind(durable=durable.name, stream=durable.stream.name)
    config = ConsumerConfig(
        durable_name=durable.name,
        name=durable.name,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        filter_subject=channel.pattern,
    )
    consumer = _PullConsumer(js, durable, config)
    this_task = asyncio.current_task()

    slots = asyncio.Semaphore(max(1, concurrency))
    in_flight: set[asyncio.Task[None]] = set()

    async def process_one(msg: Msg) -> None:
        try:
            await _process_stream_message(msg, dispatcher, max_deliver, on_give_up, log)
        finally:
            slots.release()

    async def process(msg: Msg) -> None:
        await slots.acquire()
        if concurrency <= 1:
            await process_one(msg)
            return
        task = asyncio.create_task(process_one(msg))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    try:
        while not stop.is_set():
            if consumer.nc.is_closed:
                raise BusClosed(f"consumer {durable.name}: the NATS connection is closed")
            try:
                await consumer.pull(batch, pull_expires_s, stop, process)
            except Exception as error:  # noqa: BLE001  (any transport failure: rebuild and retry)
                # nats-py turns a cancelled wait into ConnectionClosedError once the connection
                # is closed; a cancelled consumer must still end.
                if this_task is not None and this_task.cancelling():
                    raise asyncio.CancelledError from error
                if consumer.nc.is_closed:
                    raise BusClosed(f"consumer {durable.name}: {error!r}") from error
                log.warning("consumer_restarting", error=repr(error))
                await consumer.close()
                await asyncio.sleep(RESTART_DELAY_S)
    finally:
        # Handlers under way finish (their messages are acked or left to redelivery) before the
        # subscription goes; a cancelled consumer cancels them.
        if in_flight:
            if this_task is not None and this_task.cancelling():
                for task in in_flight:
                    task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
        await consumer.close()


def _attempt_of(msg: Msg) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except Exception:  # noqa: BLE001  (an ack subject that does not parse: count it as a first)
        return 1


async def _process_stream_message(
    msg: Msg,
    dispatcher: _Dispatcher,
    max_deliver: int,
    on_give_up: GiveUpHandler | None,
    log: Any,
) -> None:
    attempt = _attempt_of(msg)
    delivered = _DELIVERED.set(_stream_position(msg))
    try:
        with dispatcher.span(msg) as span:
            try:
                await dispatcher.dispatch(msg, attempt)
                # Not awaited: the handler's effects are in the ledger and its events stored,
                # so a lost ack costs only a redelivery, which the handlers deduplicate;
                # confirming each one would cost a round trip per message.
                await msg.ack()
            except Exception as error:  # noqa: BLE001  (the handler's failure is data)
                dispatcher.stats.failed += 1
                span.set_status(Status(StatusCode.ERROR, repr(error)[:500]))
                span.set_attribute("error.type", type(error).__name__)
                if attempt >= max_deliver:
                    await _give_up(msg, dispatcher, on_give_up, error, log, attempt)
                else:
                    log.warning(
                        "message_failed", error=repr(error), attempt=attempt, will_retry=True
                    )
                    try:
                        await msg.nak(delay=min(0.2 * 2**attempt, 5.0))
                    except Exception as nak_error:  # noqa: BLE001  (ack_wait redelivers anyway)
                        log.warning("nak_failed", error=repr(nak_error))
    finally:
        _DELIVERED.reset(delivered)


def _stream_position(msg: Msg) -> str:
    """``<stream>:<sequence>`` of a stream message, from its ack subject ('' if it does not
    parse)."""
    try:
        return f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"
    except Exception:  # noqa: BLE001  (not an ack subject nats-py reads)
        return ""


async def _give_up(
    msg: Msg,
    dispatcher: _Dispatcher,
    on_give_up: GiveUpHandler | None,
    error: BaseException,
    log: Any,
    attempt: int,
) -> None:
    log.error("message_failed", error=repr(error), attempt=attempt, will_retry=False)
    decoded = dispatcher.decode(msg)
    try:
        if on_give_up is None or isinstance(decoded, InvalidMessage):
            await msg.term()
            return
        await dispatcher.publisher.publish_all(on_give_up(decoded[0], error))
        await msg.ack_sync()
    except Exception as final_error:  # noqa: BLE001  (leave it to JetStream's redelivery)
        log.error("give_up_failed", error=repr(final_error))


# ---- core NATS: a subject served in a queue group --------------------------------------------


async def serve_subject(
    nc: Client,
    channel: Channel,
    handler: Handler,
    publisher: Publisher,
    queue: str,
    *,
    on_invalid: InvalidHandler | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    stats: DispatchStats | None = None,
    too_large_reply: TooLargeReply | None = None,
    concurrency: int = 1,
) -> Any:
    """Serve a core-NATS subject in a queue group; results of the channel's reply type go back to
    the requester, everything else is published. Returns the subscription, once the server
    routes the subject to it (see ``round_trip``).

    ``concurrency`` requests at most are handled at once (1: one after the other): requests that
    each wait on the ledger then share its round trips and its fsyncs instead of queueing behind
    one another. Beyond it, requests wait in the subscription's buffer.

    A reply carries the service's CloudEvents headers, never the request's. A reply that would
    exceed the server's ``max_payload`` is replaced by ``too_large_reply(reply)`` when given (and
    small enough), else by an empty body with ``Nats-Service-Error: response too large`` and
    ``Nats-Service-Error-Code: 500``; a handler that fails is answered the same way with code
    500 and the error. Either way the service keeps serving.
    """
    dispatcher = _Dispatcher(
        channel,
        handler,
        publisher,
        on_invalid,
        max_message_bytes=max_message_bytes,
        stats=stats,
        reply_nc=nc,
        too_large_reply=too_large_reply,
    )
    log = get_logger().bind(subject=channel.address, queue=queue)

    async def on_message(msg: Msg) -> None:
        with dispatcher.span(msg) as span:
            try:
                await dispatcher.dispatch(msg, attempt=1)
            except Exception as error:  # noqa: BLE001  (answer the caller, keep serving)
                dispatcher.stats.failed += 1
                span.set_status(Status(StatusCode.ERROR, repr(error)[:500]))
                log.error("request_failed", error=repr(error)[:DETAIL_LIMIT])
                if inbox := reply_inbox(msg):
                    with contextlib.suppress(Exception):
                        await nc.publish(
                            inbox, b"", headers=_service_error(repr(error)[:200], "500")
                        )

    slots = asyncio.Semaphore(max(1, concurrency))
    in_flight: set[asyncio.Task[None]] = set()

    async def handle_one(msg: Msg) -> None:
        try:
            await on_message(msg)
        finally:
            slots.release()

    async def on_message_concurrently(msg: Msg) -> None:
        await slots.acquire()  # holding up the subscription's reader when all slots are busy
        task = asyncio.create_task(handle_one(msg))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)

    callback = on_message if concurrency <= 1 else on_message_concurrently
    subscription = await nc.subscribe(channel.pattern, queue=queue, cb=callback)
    # Serving means the server routes requests here: a caller told "serving" must not be
    # answered "no responders".
    await round_trip(nc)
    return subscription


__all__ = [
    "EarlyReply",
    "INVALID_REQUEST",
    "MAX_MESSAGE_BYTES",
    "PAYLOAD_TOO_LARGE",
    "DispatchStats",
    "GiveUpHandler",
    "Handler",
    "InvalidHandler",
    "InvalidMessage",
    "PullStatusError",
    "TooLargeReply",
    "consume_stream",
    "early_reply",
    "is_stream_message",
    "serve_subject",
]
