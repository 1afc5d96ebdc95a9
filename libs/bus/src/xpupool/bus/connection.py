"""Connecting to NATS with explicit, bounded retry settings, and declaring the streams.

A connection may be secured (``xpupool.devstack.secure`` generates everything for it): TLS
(``tls://`` URL, the operator's CA, optionally a client certificate for mutual TLS) and an
identity, given as a credentials file: an NKey seed file (``SU…``) or a NATS JWT ``.creds``
file (decentralized set-ups). Each identity uses its own inbox prefix (``xpupool.contracts.
access``), because its permissions allow replies only there.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import DEFAULT_FLUSH_TIMEOUT, Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from xpupool.contracts import access, subjects
from xpupool.contracts.subjects import Stream
from xpupool.obs import get_logger

JWT_CREDS_HEADER = "-----BEGIN NATS USER JWT-----"
ErrorCallback = Callable[[Exception], Awaitable[None]]


@dataclass(frozen=True)
class BusSettings:
    """How a service reaches NATS."""

    url: str = "nats://127.0.0.1:4222"
    name: str = "xpupool"
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5
    # -1: keep trying for as long as the process lives; a service without its bus is useless,
    # and the supervisor (compose, Kubernetes) decides when to give up, not the client.
    max_reconnect_attempts: int = -1
    # How long a clean shutdown waits for in-flight messages before closing anyway.
    drain_timeout_s: float = 5.0
    # The identity: an NKey seed file or a NATS JWT .creds file ("": none, an open server).
    creds: str = ""
    # The CA that signed the server's certificate ("": the system's CAs, for a tls:// URL).
    tls_ca: str = ""
    # A client certificate and key, for a server that verifies clients (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    # Where replies to this connection's requests arrive ("": nats-py's default _INBOX).
    inbox_prefix: str = ""
    # Whether this identity creates and updates the streams (it needs the JetStream API).
    declare_streams: bool = True


def bus_settings(role: str, name: str, settings: object) -> BusSettings:
    """How the service ``role`` (an ``access`` role) reaches NATS, from its settings object
    (its ``nats_url``, ``nats_creds``, ``nats_tls_ca``, ``nats_tls_cert`` and ``nats_tls_key``
    fields; missing ones are unset): its own inbox prefix, and stream declaration unless it
    connects with an identity whose role has no JetStream API (on an open server every service
    declares the streams, as before)."""
    permissions = access.service_permissions(role)
    creds = str(getattr(settings, "nats_creds", "") or "")
    return BusSettings(
        url=str(getattr(settings, "nats_url", BusSettings.url)),
        name=name,
        creds=creds,
        tls_ca=str(getattr(settings, "nats_tls_ca", "") or ""),
        tls_cert=str(getattr(settings, "nats_tls_cert", "") or ""),
        tls_key=str(getattr(settings, "nats_tls_key", "") or ""),
        inbox_prefix=access.service_inbox(role),
        declare_streams=not creds or any(p in ("$JS.API.>", ">") for p in permissions.publish),
    )


def tls_context(
    tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None
) -> ssl.SSLContext:
    """A client TLS context that verifies the server with ``tls_ca`` (default: the system's
    CAs) and presents ``tls_cert``/``tls_key`` if given."""
    context = ssl.create_default_context(cafile=tls_ca or None)
    if tls_cert:
        context.load_cert_chain(tls_cert, tls_key or None)
    return context


def security_options(
    url: str,
    creds: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    inbox_prefix: str | None = None,
) -> dict[str, Any]:
    """The nats-py ``connect`` keywords for a credentials file, TLS and an inbox prefix."""
    options: dict[str, Any] = {}
    if creds:
        head = Path(creds).read_text(errors="replace").lstrip()[: len(JWT_CREDS_HEADER)]
        if head == JWT_CREDS_HEADER:
            options["user_credentials"] = creds
        else:
            # nats-py reads the seed file at each (re)connect, so a rotated seed is picked up.
            options["nkeys_seed"] = creds
    if tls_ca or tls_cert or url.startswith("tls://"):
        options["tls"] = tls_context(tls_ca, tls_cert, tls_key)
    if inbox_prefix:
        options["inbox_prefix"] = inbox_prefix
    return options


async def connect_client(
    url: str,
    creds: str | None = None,
    tls_ca: str | None = None,
    inbox_prefix: str | None = None,
    name: str = "xpupool-client",
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    error_cb: ErrorCallback | None = None,
    connect_timeout_s: float = 2.0,
    max_reconnect_attempts: int = 5,
) -> Client:
    """A client connection (CLI, Python client, tests): bounded reconnects, the identity in
    ``creds`` (seed or JWT .creds file), TLS verified with ``tls_ca``, replies under
    ``inbox_prefix`` (a tenant or operator must use its own: ``access.tenant_inbox``)."""
    options = security_options(url, creds, tls_ca, tls_cert, tls_key, inbox_prefix)
    if error_cb is not None:
        options["error_cb"] = error_cb
    return await nats.connect(
        url,
        name=name,
        connect_timeout=connect_timeout_s,
        # nats-py reads max_reconnect_attempts=0 as "no limit": 0 here means one attempt.
        allow_reconnect=max_reconnect_attempts != 0,
        max_reconnect_attempts=max_reconnect_attempts,
        **options,
    )


async def round_trip(nc: Client, timeout_s: int = DEFAULT_FLUSH_TIMEOUT) -> None:
    """Return once the server has processed everything ``nc`` sent before the call (each of
    its two flushes waits at most ``timeout_s``: ``nats.errors.FlushTimeoutError`` after that).

    ``Client.flush()`` alone does not promise that: nats-py (2.16) writes its PING straight to
    the socket while commands such as a new subscription's SUB wait in the pending buffer for
    the flusher task, so the PONG can answer a PING that overtook the SUB, and a request sent
    from another connection right after gets "no responders". The first flush's wait for its
    PONG is a network round trip, during which the flusher writes the buffer out; a second PING
    then goes after it on the same socket, and its PONG comes only after the SUB was applied.
    """
    await nc.flush(timeout_s)
    await nc.flush(timeout_s)


async def connect(settings: BusSettings) -> Client:
    """Connect with bounded connect timeout and unbounded reconnects, logging state changes."""
    log = get_logger().bind(nats_url=settings.url)

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", error=repr(error))

    async def on_disconnected() -> None:
        log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        log.info("nats_reconnected")

    return await nats.connect(
        settings.url,
        name=settings.name,
        connect_timeout=settings.connect_timeout_s,
        reconnect_time_wait=settings.reconnect_wait_s,
        max_reconnect_attempts=settings.max_reconnect_attempts,
        allow_reconnect=True,
        drain_timeout=settings.drain_timeout_s,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        **security_options(
            settings.url,
            settings.creds,
            settings.tls_ca,
            settings.tls_cert,
            settings.tls_key,
            settings.inbox_prefix,
        ),
    )


async def declare_streams(js: JetStreamContext, settings: BusSettings) -> None:
    """Create or update every stream of the registry, if this identity may (``settings.
    declare_streams``); an identity without the JetStream API relies on the others (or the
    operator) to have declared them."""
    if settings.declare_streams:
        await ensure_streams(js, subjects.STREAMS)


async def ensure_streams(js: JetStreamContext, streams: tuple[Stream, ...]) -> None:
    """Create each stream, or bring an existing one's subjects and limits up to date."""
    for stream in streams:
        config = StreamConfig(
            name=stream.name,
            subjects=list(stream.subjects),
            retention=RetentionPolicy.WORK_QUEUE if stream.work_queue else RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=stream.max_age_s,
            duplicate_window=stream.duplicate_window_s,
        )
        try:
            await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:
                # Another replica created it between our lookup and our create.
                await js.update_stream(config)
        else:
            await js.update_stream(config)
