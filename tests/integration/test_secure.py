"""The secured configuration on real servers: TLS only, NKey identities with the permissions of
``xpupool.contracts.access``, and Redis ACL users confined to their service's commands and keys.

Every test here fails if its protection is removed: each refusal is checked against an observer
(the operator) that would have seen the forbidden message, or against the state it would have
changed, not only against the error a client reports.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import nkeys  # type: ignore[import-untyped]
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from tests.conftest import eventually
from tests.integration.ledger_builders import device_spec, reservation
from xpupool.bus.connection import JWT_CREDS_HEADER, connect_client, round_trip, security_options
from xpupool.client import connected
from xpupool.contracts import AllocationGranted, DeviceSample, Health, JobRequested, access
from xpupool.contracts import subjects as s
from xpupool.devstack.secure import (
    LEDGER_SCRIPTS,
    MAX_PAYLOAD,
    RELAY_ROLES,
    RELAY_SCRIPTS,
    SecureMaterial,
    ledger_scripts,
    redis_acl_rules,
    script_commands,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Admission, Holder, Ledger, OutboxRelay, SliceClaim, audit
from xpupool.ledger.outbox import GROUP

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

A, B = "team-a", "team-b"
QUIET_S = 0.5  # how long an observer waits for a message that must not come


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Secured nats-server and redis-server (no services), streams declared by the operator."""
    secured = Stack(nodes=[], secure=True, tenants=[A, B], workdir=tmp_path / "stack")
    secured.start_servers()
    yield secured
    secured.stop()


def _material(stack: Stack) -> SecureMaterial:
    assert stack.material is not None
    return stack.material


class Errors:
    """What a connection's ``error_cb`` (``record``) reported."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, error: Exception) -> None:
        """The error callback."""
        self.seen.append(str(error))

    def violations(self, what: str, subject: str) -> bool:
        """Whether the server refused ``what`` ("publish"/"subscription") to ``subject``
        (nats-py reports the server's message in lowercase)."""
        wanted = f"permissions violation for {what} to {json.dumps(subject)}".lower()
        return any(wanted in e.lower() for e in self.seen)


@pytest.fixture
async def connections(stack: Stack) -> AsyncIterator[Callable[..., Awaitable[Client]]]:
    """``await connect(tenant or None, errors)``: a tenant's (or the operator's) connection."""
    opened: list[Client] = []

    async def connect(tenant: str | None, errors: Errors | None = None) -> Client:
        options = {"error_cb": errors.record} if errors else {}
        if tenant is None:
            nc = await stack.connect_operator(**options)
        else:
            nc = await stack.connect_tenant(tenant, **options)
        opened.append(nc)
        return nc

    yield connect
    for nc in opened:
        if not nc.is_closed:
            await nc.close()


async def _recorder(nc: Client, subject: str) -> list[Msg]:
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=keep)
    await round_trip(nc)  # the server has the subscription
    return seen


def _redis(stack: Stack, role: str) -> Redis:
    material = _material(stack)
    return Redis.from_url(material.redis_url(role), ssl_ca_certs=str(material.ca_path))


@pytest.fixture
async def redis_as(stack: Stack) -> AsyncIterator[Callable[[str], Redis]]:
    """``redis_as(role)``: a Redis client logged in as that role's ACL user."""
    clients: list[Redis] = []

    def login(role: str) -> Redis:
        client = _redis(stack, role)
        clients.append(client)
        return client

    yield login
    for client in clients:
        await client.aclose()


# ---- transport -------------------------------------------------------------------------------


def test_plaintext_nats_client_is_refused(stack: Stack) -> None:
    """A plaintext client with a valid NKey signature is cut off before it can do anything."""
    assert stack.nats is not None
    seed = bytearray(stack.operator_creds().read_bytes().strip())
    with socket.create_connection(("127.0.0.1", stack.nats.port), timeout=5) as sock:
        info = json.loads(sock.recv(4096).split(b" ", 1)[1])
        assert info["tls_required"] is True
        key = nkeys.from_seed(seed)
        sig = base64.urlsafe_b64encode(key.sign(info["nonce"].encode())).rstrip(b"=").decode()
        connect = {"verbose": False, "nkey": key.public_key.decode(), "sig": sig, "protocol": 1}
        sock.sendall(f"CONNECT {json.dumps(connect)}\r\nPING\r\n".encode())
        try:
            reply = sock.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert b"PONG" not in reply


def test_plaintext_redis_client_is_refused(stack: Stack) -> None:
    """Right credentials over plaintext get no answer from the TLS-only Redis."""
    assert stack.redis is not None
    password = _material(stack).redis_passwords[access.OPERATOR]
    with socket.create_connection(("127.0.0.1", stack.redis.port), timeout=5) as sock:
        sock.sendall(f"AUTH {access.OPERATOR} {password}\r\nPING\r\n".encode())
        try:
            reply = sock.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert b"+OK" not in reply and b"PONG" not in reply


async def test_unknown_or_missing_nkey_is_refused(stack: Stack, tmp_path: Path) -> None:
    """Over valid TLS, a key the server does not know and no key at all are both refused."""
    stranger = tmp_path / "stranger.seed"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    ca = str(_material(stack).ca_path)
    assert stack.nats_url
    for creds in (str(stranger), None):
        with pytest.raises(Exception, match="(?i)authorization"):
            nc = await connect_client(
                stack.nats_url, creds=creds, tls_ca=ca, max_reconnect_attempts=0
            )
            await nc.close()
    # The same TLS set-up with a known key connects: the refusals above were the key's.
    nc = await connect_client(stack.nats_url, creds=str(stack.tenant_creds(A)), tls_ca=ca)
    await nc.close()


# ---- NATS permissions --------------------------------------------------------------------------


async def test_tenant_cannot_publish_on_internal_or_other_tenants_subjects(
    stack: Stack, connections: Callable[..., Awaitable[Client]]
) -> None:
    """Tenant A's publishes to internal subjects, the JetStream API and B's commands are
    refused and reach no one; the stream A tried to delete is still there."""
    operator = await connections(None)
    errors = Errors()
    tenant = await connections(A, errors)
    forbidden = [
        s.JOB_RESERVED.address,
        s.SIM_FAULT.subject(node_id="x"),
        s.ALLOC_GRANTED.address,
        f"$JS.API.STREAM.DELETE.{s.JOBS_STREAM.name}",
        s.JOB_REQUESTED.subject(tenant=B),
        s.LEASE_RELEASE.subject(tenant=B),
    ]
    observed = {subject: await _recorder(operator, subject) for subject in forbidden}
    for subject in forbidden:
        await tenant.publish(subject, b"{}")
    await tenant.flush()
    await eventually(lambda: all(errors.violations("publish", x) for x in forbidden))
    await asyncio.sleep(QUIET_S)
    assert {x: len(m) for x, m in observed.items()} == dict.fromkeys(forbidden, 0)
    info = await operator.jetstream().stream_info(s.JOBS_STREAM.name)
    assert info.state.messages == 0  # B's job request did not land either


async def test_tenant_cannot_subscribe_to_other_tenants_or_internal_subjects(
    stack: Stack, connections: Callable[..., Awaitable[Client]]
) -> None:
    """Tenant A may not subscribe to B's events, every inbox or the operator copies, and gets
    nothing the operator publishes there, while its own events reach it."""
    operator = await connections(None)
    errors = Errors()
    tenant = await connections(A, errors)
    b_events = s.TENANT_ALLOC_GRANTED.subject(tenant=B)
    forbidden = {
        f"{s.TENANT_SPACE}.{B}.events.>": b_events,
        "_INBOX.>": f"{access.tenant_inbox(B)}.reply",
        "xpupool.alloc.v1.>": s.ALLOC_GRANTED.address,
    }
    received = {pattern: await _recorder(tenant, pattern) for pattern in forbidden}
    own = await _recorder(tenant, f"{s.TENANT_SPACE}.{A}.events.>")
    await eventually(lambda: all(errors.violations("subscription", p) for p in forbidden))
    for subject in forbidden.values():
        await operator.publish(subject, b"{}")
    await operator.publish(s.TENANT_ALLOC_GRANTED.subject(tenant=A), b"{}")
    await operator.flush()
    await eventually(lambda: own)
    await asyncio.sleep(QUIET_S)
    assert {p: len(m) for p, m in received.items()} == dict.fromkeys(forbidden, 0)


async def test_tenant_publishes_its_own_job_request_into_the_jobs_stream(
    stack: Stack, connections: Callable[..., Awaitable[Client]]
) -> None:
    """Tenant A's job request on its own subject is stored by JetStream and acknowledged."""
    tenant = await connections(A)
    ack = await tenant.jetstream().publish(
        s.JOB_REQUESTED.subject(tenant=A), b"{}", headers={"Nats-Msg-Id": "a-1"}, timeout=5
    )
    assert ack.stream == s.JOBS_STREAM.name and not ack.duplicate
    operator = await connections(None)
    info = await operator.jetstream().stream_info(s.JOBS_STREAM.name)
    assert info.state.messages == 1


async def test_server_limits_payloads_to_256_kib(
    connections: Callable[..., Awaitable[Client]],
) -> None:
    """The secured server announces a 256 KiB max_payload, so a larger message is never sent."""
    tenant = await connections(A)
    assert tenant.max_payload == MAX_PAYLOAD == 256 * 1024
    with pytest.raises(MaxPayloadError):
        await tenant.publish(s.JOB_REQUESTED.subject(tenant=A), b"x" * (MAX_PAYLOAD + 1))


async def test_rotated_nkey_replaces_the_old_one(
    stack: Stack, connections: Callable[..., Awaitable[Client]], tmp_path: Path
) -> None:
    """After a seed rotation and a server reload the old seed is refused and the new one
    works."""
    assert stack.nats is not None and stack.nats_url
    material = _material(stack)
    old = tmp_path / "old.seed"
    old.write_bytes(stack.tenant_creds(A).read_bytes())
    material.rotate_seed("tenant", A)
    stack.nats.reload()
    ca = str(material.ca_path)

    async def old_refused() -> bool:
        try:
            nc = await connect_client(
                stack.nats_url or "", creds=str(old), tls_ca=ca, max_reconnect_attempts=0
            )
        except Exception:  # noqa: BLE001  (refused: what we wait for)
            return True
        await nc.close()
        return False

    await eventually(old_refused, timeout_s=10)
    nc = await connections(A)
    ack = await nc.jetstream().publish(s.JOB_REQUESTED.subject(tenant=A), b"{}", timeout=5)
    assert ack.stream == s.JOBS_STREAM.name


def test_credentials_file_kind_picks_the_nats_py_option(tmp_path: Path) -> None:
    """A NATS JWT .creds file is passed as user_credentials, anything else as an NKey seed."""
    jwt = tmp_path / "user.creds"
    jwt.write_text(f"{JWT_CREDS_HEADER}\neyJ0eXAi...\n------END NATS USER JWT------\n")
    seed = tmp_path / "user.seed"
    seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    assert security_options("nats://x:4222", str(jwt)) == {"user_credentials": str(jwt)}
    assert security_options("nats://x:4222", str(seed)) == {"nkeys_seed": str(seed)}
    assert "tls" in security_options("tls://x:4222")


async def test_rotated_redis_password_replaces_the_old_one(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """After a password rotation and ACL LOAD the old password is refused and the new one
    works."""
    material = _material(stack)
    old = _redis(stack, access.SCHEDULER)
    assert await old.ping()
    await old.aclose()
    material.rotate_redis_password(access.SCHEDULER)
    await redis_as(access.OPERATOR).acl_load()
    with pytest.raises(AuthenticationError):
        await old.ping()  # a new connection authenticates with the old password
    await old.aclose()
    assert await redis_as(access.SCHEDULER).ping()


# ---- Redis ACL ----------------------------------------------------------------------------------


def test_every_ledger_script_belongs_to_one_role() -> None:
    """Each Lua script is in exactly one role's ACL list, or the relay's (which every role with
    an outbox runs), so a new script cannot be forgotten."""
    assigned = [name for names in LEDGER_SCRIPTS.values() for name in names]
    assert sorted([*assigned, *RELAY_SCRIPTS]) == sorted(ledger_scripts())


def test_a_script_allows_only_the_subcommands_it_names() -> None:
    """The relay's script deletes consumers and reads the group: its roles may run
    ``XGROUP DELCONSUMER`` and ``XINFO CONSUMERS``, not every XGROUP (DESTROY, SETID)."""
    assert script_commands(RELAY_SCRIPTS) >= {"xgroup|delconsumer", "xinfo|consumers"}
    assert not {"xgroup", "xinfo"} & script_commands(RELAY_SCRIPTS)
    for role in RELAY_ROLES:
        rules = redis_acl_rules(role, "ns").split()
        assert "+xgroup|delconsumer" in rules and "+xgroup" not in rules
    assert "+xgroup|delconsumer" not in redis_acl_rules(access.AUTOSCALER, "ns").split()


async def _refused(call: Awaitable[object]) -> str:
    """The refusal of a Redis call (NOPERM, or a script's ACL error)."""
    with pytest.raises(ResponseError) as refusal:
        await call
    text = str(refusal.value)
    assert isinstance(refusal.value, NoPermissionError) or "can't access" in text, text
    return text


async def test_collector_runs_its_ledger_flows_and_nothing_else(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """The collector user registers, heartbeats, sets health, records load, reads its holders
    and ends leases of a vanished device; lease writes, admin commands and key scans fail."""
    ns = stack.namespace
    collector = Ledger(redis_as(access.TELEMETRY_COLLECTOR), ns)
    scheduler = Ledger(redis_as(access.SCHEDULER), ns)
    lease_manager = Ledger(redis_as(access.LEASE_MANAGER), ns)
    operator = Ledger(redis_as(access.OPERATOR), ns)
    devices = [device_spec("n1", 0), device_spec("n1", 1)]
    assert (await collector.register_node("n1", devices, 64_000, 256_000)).ok
    assert (await collector.heartbeat("n1")).ok
    assert (await collector.set_health("n1/nvidia0", Health.UNHEALTHY, "ecc")).ok
    assert (await collector.set_health("n1/nvidia0", Health.HEALTHY)).previous == "unhealthy"
    assert (
        await collector.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=9.0)])
    ).ok
    assert len(await collector.node_devices("n1")) == 2
    assert (await scheduler.reserve(reservation("gone", SliceClaim("n1/nvidia1", whole=True)))).ok
    granted = await lease_manager.grant("lease-gone")
    assert granted.ok
    assert [lease and lease.job_id for lease in await collector.get_leases(["lease-gone"])] == [
        "gone"
    ]
    # A restarted collector without nvidia1: its lease ends as lost, by the collector's user.
    result = await collector.register_node("n1", devices[:1], 64_000, 256_000)
    assert result.ok and result.lost == ["lease-gone"], result
    assert await audit(operator) == []

    assert (await scheduler.reserve(reservation("held", SliceClaim("n1/nvidia0", 1024, 10)))).ok
    before = await operator.get_lease("lease-held")
    redis = collector.redis
    await _refused(collector.grant("lease-held"))  # a lease-manager script
    await _refused(redis.set(collector.key("lease", "x"), "1"))
    await _refused(redis.zadd(collector.key("expiry"), {"lease-held": 1}))
    await _refused(redis.xadd(collector.key("outbox", "scheduler"), {"kind": "x"}))
    await _refused(redis.flushall())
    await _refused(redis.config_set("appendonly", "no"))
    await _refused(redis.keys("*"))
    assert await operator.get_lease("lease-held") == before
    assert not await operator.redis.exists(collector.key("lease", "x"))


async def test_scheduler_runs_its_ledger_flows_and_nothing_else(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """The scheduler user admits, reserves, reads and relays its outbox; admin commands
    fail."""
    ns = stack.namespace
    await Ledger(redis_as(access.TELEMETRY_COLLECTOR), ns).register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000
    )
    scheduler = Ledger(redis_as(access.SCHEDULER), ns)
    assert (await scheduler.pend("p1", 500, b"{}", 60_000, "queued", tenant=A)).ok
    assert [j.job_id for _, j in await scheduler.pending_jobs()] == ["p1"]
    assert await scheduler.note_pending("p1", "no_capacity", "full", nominated=True)
    assert await scheduler.pending_count(A) == 1
    results = await scheduler.reserve_many(
        [reservation("p1", SliceClaim("n1/nvidia0", whole=True))]
    )
    assert results[0].ok, results
    assert (await scheduler.request_preemption("lease-p1", "urgent")).ok
    assert (await scheduler.pend("p2", 500, b"{}", 1, "queued", tenant=A)).ok
    await asyncio.sleep(0.05)
    assert (await scheduler.time_out_pending()).ok
    assert (await scheduler.pend("p3", 500, b"{}", None, "queued", tenant=A)).ok
    assert (await scheduler.drop_pending("p3", "invalid_request", "count", "")).ok
    # jobs.list: a waiting job its tenant's index lost is searched for in the queue.
    assert (await scheduler.pend("p4", 500, b"{}", None, "queued", tenant=A)).ok
    await redis_as(access.OPERATOR).zrem(scheduler.key("tenant-jobs", A), "p4")
    assert "p4" in [j.job_id for j in await scheduler.tenant_jobs(A, 10)]
    # An admission placed on arrival by a replica that follows the change feed: the script
    # asks how many follow it (PUBSUB NUMSUB) before it announces its change.
    placed = reservation("p5", SliceClaim("n1/nvidia1", 1024, 10), tenant=A, secret="s" * 48)
    [admitted] = await scheduler.admit_many(
        [
            Admission(
                "p5",
                500,
                b"{}",
                None,
                "queued",
                tenant=A,
                placement=placed,
                caller_follows_feed=True,
            )
        ]
    )
    assert admitted.ok, admitted
    assert await scheduler.acquire("cycle", "me", 1_000)
    await scheduler.release_lock("cycle", "me")
    changes = await scheduler.changes_since(None)
    assert (await scheduler.changes_since(changes.cursor)).complete
    assert len(await scheduler.nodes()) == 1 and len(await scheduler.leases()) == 1
    assert await scheduler.get_nodes(["n1"]) and await scheduler.live_leases(["lease-p1"])
    assert await scheduler.get_job("p1") is not None and await scheduler.now_ms() > 0
    await _drain_outbox(scheduler, "scheduler", redis_as(access.OPERATOR))

    redis = scheduler.redis
    await _refused(redis.flushall())
    await _refused(redis.config_get("*"))
    await _refused(redis.keys("*"))
    await _refused(redis.acl_list())


async def test_lease_manager_runs_its_ledger_flows_and_nothing_else(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """The lease-manager user grants, renews, releases, ends, expires, reaps, relays and counts
    the live leases for its gauge; admin commands fail."""
    ns = stack.namespace
    await Ledger(redis_as(access.TELEMETRY_COLLECTOR), ns).register_node(
        "n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000
    )
    scheduler = Ledger(redis_as(access.SCHEDULER), ns)
    manager = Ledger(redis_as(access.LEASE_MANAGER), ns)
    for job, device in (("a", "n1/nvidia0"), ("b", "n1/nvidia1")):
        await scheduler.reserve(reservation(job, SliceClaim(device, 1024, 10), tenant=A))
    granted = await manager.grant("lease-a", "secret")
    holder = Holder(A, "secret", granted.token)
    assert (await manager.renew("lease-a", holder, 60_000)).ok
    assert (await manager.release("lease-a", holder)).ok
    await manager.grant("lease-b")
    assert await manager.lease_states(chunk=1) == {"active": 1}
    assert (await manager.end("lease-b", "preempted")).ok
    assert (await manager.expire_due()).ok
    assert (await manager.reap_nodes(60_000)).ok
    lease = await manager.get_lease("lease-a")
    assert lease is not None and lease.end_reason == "released"
    await _drain_outbox(manager, "lease-manager", redis_as(access.OPERATOR))

    redis = manager.redis
    await _refused(redis.flushall())
    await _refused(redis.config_set("appendonly", "no"))
    await _refused(redis.keys("*"))
    await _refused(redis.script_flush())


async def test_autoscaler_runs_its_ledger_flows_and_nothing_else(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """The autoscaler user reads the ledger (nodes, leases, pending jobs, time), drains a node,
    and keeps its own fenced state (leader lease, journal, node records, histories, status)
    with its scripts; other roles' write commands and admin commands are refused."""
    from xpupool.autoscaler.state import AutoscalerState

    ns = stack.namespace
    await Ledger(redis_as(access.TELEMETRY_COLLECTOR), ns).register_node(
        "n1", [device_spec("n1", 0)], 64_000, 256_000
    )
    scaler = Ledger(redis_as(access.AUTOSCALER), ns)
    assert len(await scaler.nodes()) == 1 and await scaler.leases() == []
    assert await scaler.pending_jobs() == [] and await scaler.now_ms() > 0
    assert (await scaler.set_node_draining("n1", True)).ok
    assert (await scaler.nodes())[0].draining
    state = AutoscalerState(scaler.redis, scaler.prefix, "replica-a")
    term = await state.hold(5_000)
    assert term == 1 and await state.leader() == ("replica-a", 1)
    await state.write(
        term,
        [["SET", "status", "{}"], ["HSET", "busy:pool", "0", "1"], ["HDEL", "busy:pool", "9"]],
    )
    assert await state.series("busy:pool") == [(0.0, 1.0)]
    assert await state.journal() == {} and await state.nodes() == {}
    assert await state.status_json() == b"{}"
    await state.resign()
    # Commands outside its flows (another role's writes) and admin commands are refused.
    redis = scaler.redis
    await _refused(redis.sadd(scaler.key("nodes"), "forged-node"))
    await _refused(redis.lpush(scaler.key("autoscaler", "x"), "1"))
    await _refused(redis.flushall())
    await _refused(redis.keys("*"))
    await _refused(redis.config_get("*"))


async def test_redis_users_are_confined_to_the_ledger_prefix(
    stack: Stack, redis_as: Callable[[str], Redis]
) -> None:
    """No service user reads or writes a key outside its namespace, by command or script."""
    other = Ledger(redis_as(access.OPERATOR), "other")
    await other.register_node("n9", [device_spec("n9", 0)])
    for role in (access.SCHEDULER, access.LEASE_MANAGER, access.TELEMETRY_COLLECTOR):
        redis = redis_as(role)
        await _refused(redis.hgetall(other.key("node", "n9")))
        await _refused(redis.get("plain-key"))
        await _refused(Ledger(redis, "other").heartbeat("n9"))
        await _refused(Ledger(redis, "other").nodes())
    assert await other.redis.exists(other.key("node", "n9"))


async def _drain_outbox(ledger: Ledger, service: str, observer: Redis) -> None:
    """Run the service's outbox relay (consumer group, read, claim, ack, delete) until its
    outbox is empty, then delete its consumer as a peer's relay would once it is idle."""
    published: list[object] = []

    async def build(entries: list[dict[str, str]]) -> list[list[object]]:
        return [[fields] for fields in entries]

    async def send(event: object) -> list[object]:
        published.append(event)
        return []

    stop = asyncio.Event()
    relay = OutboxRelay(ledger, service, build, send)  # type: ignore[arg-type]
    task = asyncio.create_task(relay.run(stop))
    outbox = ledger.key("outbox", service)

    async def drained() -> bool:
        return bool(published) and await observer.xlen(outbox) == 0

    try:
        await eventually(drained, timeout_s=10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert await ledger.reap_relay_consumers(service, GROUP, "a-peer", 0) != []
    assert await observer.xinfo_consumers(outbox, GROUP) == []


# ---- the whole stack -------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(120)
async def test_secure_stack_serves_a_tenant_with_no_refusal_logged(tmp_path: Path) -> None:
    """Every service on its own identity grants and releases a tenant's job, and neither Redis
    nor any service logged a refusal (its ACL and permissions cover what it really does)."""
    stack = Stack(
        nodes=[NodeSpec("node-a", "2xA100-80GB")],
        secure=True,
        tenants=[A],
        workdir=tmp_path / "stack",
        extra_env={"XPUPOOL_LOG_LEVEL": "info"},
    )
    try:
        stack.start()
        operator = _redis(stack, access.OPERATOR)
        ledger = Ledger(operator, stack.namespace)

        async def registered() -> bool:
            return sum(len(n.devices) for n in await ledger.nodes()) == 2

        await eventually(registered, timeout_s=30)
        await stack.wait_until_pulling()
        assert stack.nats_url and stack.tls_ca
        creds, ca = str(stack.tenant_creds(A)), str(stack.tls_ca)
        async with connected(stack.nats_url, A, creds=creds, tls_ca=ca) as client:
            outcome = await client.submit_and_wait(JobRequested(job_id="s-1", tenant=A))
            assert isinstance(outcome, AllocationGranted), outcome
            assert (await client.release(outcome.lease_id, outcome.fencing_token)).ok

        async def released() -> bool:
            lease = await ledger.get_lease(outcome.lease_id)
            return lease is not None and lease.end_reason == "released"

        await eventually(released)
        assert await audit(ledger) == []
        # CLIENT SETINFO (redis-py, Redis >= 7.2) is refused on purpose and ignored by redis-py.
        refusals = [e for e in await operator.acl_log() if e.get("object") != "client|setinfo"]
        assert refusals == []
        await operator.aclose()
    finally:
        stack.stop()
    logs = stack.logs().lower()
    assert "permissions violation" not in logs and "noperm" not in logs, stack.logs()


async def _publish_job_request(env: dict[str, str]) -> str:
    """Connect with a printed tenant environment and publish a job request; the stream's
    name from the acknowledgement."""
    nc = await connect_client(
        env["XPUPOOL_NATS_URL"],
        creds=env["XPUPOOL_NATS_CREDS"],
        tls_ca=env["XPUPOOL_NATS_TLS_CA"],
        inbox_prefix=access.tenant_inbox(A),
    )
    try:
        ack = await nc.jetstream().publish(s.JOB_REQUESTED.subject(tenant=A), b"{}", timeout=5)
    finally:
        await nc.close()
    return ack.stream


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_dev_up_secure_prints_how_a_tenant_connects() -> None:
    """`xpupool dev up --secure` prints each tenant's URL, creds, CA and subjects; with exactly
    that a tenant publishes a job request, and Ctrl-C leaves no process behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUPOOL_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "xpupool.cli.main", "dev", "up", "--secure", "--tenants", A],
        env=env | {"XPUPOOL_LOG_LEVEL": "warning"},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        while not lines or "Ctrl-C" not in lines[-1]:
            line = process.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        printed = dict(
            line.strip().removeprefix("export ").split("=", 1)
            for line in lines[lines.index(f"tenant {A}\n") :]
            if line.strip().startswith("export ")
        )
        assert printed["XPUPOOL_NATS_URL"].startswith("tls://127.0.0.1:")
        assert f"publish   {s.TENANT_SPACE}.{A}.jobs.>" in "".join(lines)
        assert asyncio.run(_publish_job_request(printed)) == s.JOBS_STREAM.name
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        process.stdout.close()
    workdir = lines[-1].split()[2].rstrip(";")
    leftovers = subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


async def test_the_default_redis_user_is_unusable_and_the_ledger_survives_a_restart(
    stack: Stack,
) -> None:
    """No connection can act as ``default`` (with or without a password), and a ledger written
    by scripts comes back whole from the AOF after a crash under the ACL file (Redis 7.0 replays
    script writes under the default user's rights)."""
    material, server = stack.material, stack.redis
    assert material is not None and server is not None
    operator = Redis.from_url(material.redis_url(access.OPERATOR, with_ca=True))
    # Two writes: the AOF wraps a script's writes in MULTI/EXEC, which is what went missing.
    script = "redis.call('SET', KEYS[1], 'kept') redis.call('INCR', KEYS[2]) return 1"
    await operator.eval(script, 2, "{xpupool}:probe", "{xpupool}:probe-n")
    await operator.aclose()
    for password in (None, "anything"):
        anonymous = Redis(
            host="127.0.0.1",
            port=material.redis_port,
            username="default" if password else None,
            password=password,
            ssl=True,
            ssl_ca_certs=str(material.ca_path),
        )
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.get("{xpupool}:probe")
        await anonymous.aclose()
    server.restart()  # SIGKILL, then start from the AOF
    operator = Redis.from_url(material.redis_url(access.OPERATOR, with_ca=True))
    assert await operator.get("{xpupool}:probe") == b"kept"
    await operator.aclose()
