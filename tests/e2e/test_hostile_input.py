"""Hostile input against a running stack: no message silences a service, every bad request is
answered with a rejection naming what was wrong, and the pool keeps granting valid jobs."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import Ready
from xpupool.client import TenantEvent, XpupoolClient, connected
from xpupool.contracts import (
    AllocationGranted,
    JobPending,
    JobReason,
    JobRejected,
    JobRequested,
    LeaseError,
)
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

# Under the services' 64 KiB message limit, far over what any field allows: the rejection names
# the field. HUGE is under nats-server's default max_payload (1 MB) and over the 64 KiB limit.
BIG = "x" * 60_000
HUGE = "x" * 900_000


async def _still_serving(client: XpupoolClient, job_id: str) -> float:
    """Submit a valid job of another tenant; return how long its grant took (then release)."""
    started = time.perf_counter()
    outcome = await client.submit_and_wait(JobRequested(job_id=job_id, tenant="good"), timeout_s=10)
    took = time.perf_counter() - started
    assert isinstance(outcome, AllocationGranted), outcome
    await client.release(outcome.lease_id, outcome.fencing_token)
    return took


def _raw_publish(port: int, subject: str, header_block: bytes, payload: bytes) -> None:
    """Publish with a hand-written header block, as a non-conforming client could (a status
    line where a client's headers belong)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"headers":true,"protocol":1}\r\n')
        total = len(header_block) + len(payload)
        sock.sendall(
            b"HPUB %s %d %d\r\n%s%s\r\nPING\r\n"
            % (subject.encode(), len(header_block), total, header_block, payload)
        )
        assert b"PONG" in sock.recv(4096)


HOSTILE: list[tuple[str, bytes, str | None]] = [
    # (what, payload, the field the rejection must name or None)
    ("huge message", json.dumps({"job_id": "h-huge", "intent": HUGE}).encode(), None),
    ("huge type", json.dumps({"type": BIG, "job_id": "h-type"}).encode(), "type"),
    ("huge intent", json.dumps({"job_id": "h-intent", "intent": BIG}).encode(), "intent"),
    ("huge priority", json.dumps({"job_id": "h-prio", "priority": BIG}).encode(), "priority"),
    (
        "huge vendor",
        json.dumps({"job_id": "h-vendor", "selector": {"vendor": BIG}}).encode(),
        "selector.vendor",
    ),
    (
        "huge models",
        json.dumps({"job_id": "h-models", "selector": {"models": [BIG]}}).encode(),
        "selector.models",
    ),
    ("deep nesting", b'{"job_id":"h-deep","labels":' + b"[" * 10_000 + b"]" * 10_000 + b"}", None),
    ("max_wait 1e308", b'{"job_id":"h-wait","max_wait_s":1e308}', "max_wait_s"),
    ("infinite count", b'{"job_id":"h-inf","count":1e999}', "count"),
    ("NaN", b'{"job_id":"h-nan","lease_ttl_s":NaN}', None),
    ("invalid UTF-8", b'{"job_id":"h-utf8","labels":{"k":"\xff\xfe"}}', None),
    ("unknown field", b'{"job_id":"h-typo","device":{"compute_percent":30}}', "device"),
]


@pytest.mark.parametrize(("what", "payload", "field"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_request_is_rejected_and_the_pool_keeps_serving(
    make_stack: Callable[..., Stack],
    ready: Ready,
    what: str,
    payload: bytes,
    field: str | None,
) -> None:
    """Each kind of hostile request gets one bounded rejection naming the field (where one is
    to blame), and a valid job from another tenant is granted right after."""
    stack = make_stack([NodeSpec("node-a", "2xA100-80GB")])
    ledger = await ready(stack, 2)
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        rejections: list[JobRejected] = []

        def on_event(event: TenantEvent) -> None:
            if isinstance(event, JobRejected) and event.tenant == "evil":
                rejections.append(event)

        client.listen(on_event)
        msg_id = f"hostile-{what.replace(' ', '-')}"
        await client.submit_raw(payload, msg_id=msg_id, tenant="evil")
        for _ in range(100):
            if rejections:
                break
            await asyncio.sleep(0.1)
        assert len(rejections) == 1, f"{what}: {rejections}"
        rejection = rejections[0]
        assert rejection.reason in (JobReason.INVALID_REQUEST, JobReason.PAYLOAD_TOO_LARGE)
        assert len(rejection.detail) <= 1024 and BIG[:200] not in rejection.detail
        # The sender can tell which request was refused: by its job id, or where the payload is
        # too large or not even JSON, by the Nats-Msg-Id it published with.
        assert rejection.job_id in (msg_id, f"h-{what.split()[-1]}") or rejection.job_id.startswith(
            "h-"
        ), rejection
        if field is not None:
            assert rejection.field_name and rejection.field_name.startswith(field), rejection
        took = await _still_serving(client, f"after-{what.replace(' ', '-')}")
        print(f"{what}: next valid grant after {took * 1000:.0f} ms")
    assert await audit(ledger) == []


async def test_oversized_lease_commands_do_not_silence_the_lease_manager(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A renew whose lease id is huge, and one with huge headers, get a short error reply; the
    lease-manager keeps answering and releasing."""
    stack = make_stack([NodeSpec("node-a", "1xA100-80GB")])
    await ready(stack, 1)
    await stack.wait_until_pulling()  # the lease-manager serves its subjects before it pulls
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        body = json.dumps({"lease_id": BIG, "lease_secret": "s", "fencing_token": 1}).encode()
        reply = await client.nc.request(
            s.LEASE_RENEW.subject(tenant="evil"),
            body[:900_000],
            timeout=5,
            headers={"X-Junk": "y" * 100_000},
        )
        assert len(reply.data) < 2048 and "X-Junk" not in (reply.headers or {})
        answer = json.loads(reply.data)
        assert answer["ok"] is False
        assert answer["error"] in (LeaseError.INVALID_REQUEST, LeaseError.PAYLOAD_TOO_LARGE)
        await _still_serving(client, "after-huge-renew")


async def test_status_line_headers_do_not_hide_a_request(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A request stored with a header block that looks like a NATS status line is handled like
    any other (granted), not mistaken for a server status and left unanswered."""
    stack = make_stack([NodeSpec("node-a", "1xA100-80GB")])
    await ready(stack, 1)
    assert stack.nats_url
    port = int(stack.nats_url.rsplit(":", 1)[1])
    async with connected(stack.nats_url) as client:
        for status in (b"503", b"404 No Messages", b"408 Request Timeout"):
            job_id = f"status-{status[:3].decode()}"
            waiter = client.expect(job_id)
            payload = json.dumps({"job_id": job_id}).encode()
            headers = b"NATS/1.0 " + status + b"\r\nNats-Msg-Id: " + job_id.encode() + b"\r\n\r\n"
            _raw_publish(port, s.JOB_REQUESTED.subject(tenant="raw"), headers, payload)
            outcome = await asyncio.wait_for(waiter, 15)
            assert isinstance(outcome, AllocationGranted), outcome
            await client.release(outcome.lease_id, outcome.fencing_token)


# ---- generated hostile input ---------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = st.sampled_from(
    [
        "count",
        "device",
        "selector",
        "host",
        "gang",
        "lease_ttl_s",
        "owner",
        "queue",
        "priority",
        "max_wait_s",
        "expected_duration_s",
        "intent",
        "labels",
        "tenant",
        "type",
    ]
)
_RAW_TOKENS = st.sampled_from(
    [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"9" * 400, b'"\xff"', b"[" * 2000]
)


@st.composite
def hostile_requests(draw: st.DrawFn, job_id: str) -> bytes:
    """A job request with valid and hostile fields mixed: random JSON values, unknown fields,
    and raw tokens JSON does not allow (NaN, infinities, huge numbers, invalid UTF-8)."""
    body: dict[str, object] = {"job_id": job_id}
    for name in draw(st.lists(_FIELDS, max_size=4, unique=True)):
        body[name] = draw(_JSON)
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=10).filter(lambda k: k != "job_id"))] = draw(_JSON)
    data = json.dumps(body).encode()
    if draw(st.booleans()):
        token = draw(_RAW_TOKENS)
        data = data[:-1] + b',"lease_ttl_s":' + token + b"}"
    return data


async def test_generated_hostile_requests_each_get_one_answer(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """Hypothesis-generated requests each end in exactly one outcome (a rejection naming the
    problem, or a grant if the draw happened to be valid), and no service stops serving."""
    stack = make_stack([NodeSpec("node-a", "2xA100-80GB")])
    ledger = await ready(stack, 2)
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        outcomes: dict[str, list[TenantEvent]] = {}

        def on_event(event: TenantEvent) -> None:
            if not isinstance(event, JobPending):
                outcomes.setdefault(getattr(event, "job_id", ""), []).append(event)

        client.listen(on_event)
        counter = iter(range(10**6))
        loop = asyncio.get_running_loop()
        payloads: list[tuple[str, bytes]] = []

        @settings(
            max_examples=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def collect(data: st.DataObject) -> None:
            job_id = f"gen-{next(counter)}"
            payloads.append((job_id, data.draw(hostile_requests(job_id))))

        await loop.run_in_executor(None, collect)
        for job_id, payload in payloads:
            await client.submit_raw(payload, msg_id=job_id, tenant="fuzz")
        for _ in range(300):
            if all(outcomes.get(j) for j, _ in payloads):
                break
            await asyncio.sleep(0.1)
        missing = [j for j, _ in payloads if not outcomes.get(j)]
        assert not missing, f"no outcome for {missing}"
        for job_id, _ in payloads:
            events = outcomes[job_id]
            assert len(events) == 1, (job_id, events)
            if isinstance(events[0], AllocationGranted):
                await client.release(events[0].lease_id, events[0].fencing_token)
        await _still_serving(client, "after-generated")
    assert await audit(ledger) == []
