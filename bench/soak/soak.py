"""Soak: the whole stack under steady load while faults are injected, then the reliability plan's
invariants checked on what it left (``xpupool.devstack.invariants``: I1 no double allocation,
in the ledger's records, its fencing tokens and against the grants the stream stored, I2 one
outcome per accepted request and one end per grant, I3 nothing leaked, I4 a queue's limit never
exceeded, I6 no tenant sent another's events) and the ledger's audit; I5 (stale tokens) and I6
(another tenant's commands) are checked by the clients as they are answered.

    uv run python bench/soak/soak.py [--minutes 10] [--seed 1] [--workers 8] [--fault-every-s 15]
        [--faults kill,pause,restart,failpoint] [--replicas 1] [--secure] [--out PATH]

The stack is the embedded one (NATS with JetStream, Redis with AOF ``appendfsync always``, every
service its own process) with four simulated nodes of four A100s. Workers of two tenants submit
jobs one after another, by request/reply (a request no scheduler answers is put on the stream as
well, as the client does): whole devices, shares, two-device gangs, requests too large to fit
(rejected), gangs with a short ``max_wait_s`` (timed out when the pool is busy) and jobs cancelled
at once (cancelled, or granted and then released). A granted job is held for a while, renewed
sometimes, and released; a release that fails (its service down) leaves the lease to expire at
the end of its 10-second term. The queues give alpha a guarantee of 10 of the 16 devices, which
preempts beta's borrowed leases when it needs them back, and beta a limit of 6 (I4). Holders
sometimes renew with an older token, or release and renew again after the end (I5: refused).
A third tenant, mallory, releases and renews the others' live leases with their own secrets and
tokens (as if leaked), cancels their jobs and submits in their names, all of which must be
refused (I6); a recorder keeps every event the tenants' subjects carry. ``--replicas 2`` runs
two schedulers and two lease-managers, so that the faults hit one of two; ``--secure`` the secured
stack (TLS, every tenant and service with its own credentials and permissions, Redis ACLs).

Every ``--fault-every-s`` one fault from the families in ``--faults`` (each family once per
round, in an order and with details the seed chooses):
``kill`` (SIGKILL the scheduler, the lease-manager or a collector, started again after up to 1.5
s), ``pause`` (SIGSTOP nats-server, redis-server, the scheduler or the lease-manager for up to 3
s), ``restart`` (nats-server or redis-server killed and started again on its data) and
``failpoint`` (the scheduler or the lease-manager restarted with one failpoint armed, ``1*kill``,
and started again clean once it died there, or ``3*stall(1000)``, and started again clean after
6 s). Faults stop for the last fifth of the
run (at least 10 s), so the stack is seen to recover; then the load stops, the run waits until no
job waits and no lease is live (every held lease released or expired), and reads the streams and
the ledger.

Prints one line per fault and a summary; exits 1 on any violation (listed) and writes the
report as JSON with ``--out``. ``just soak`` runs ten minutes; the default test run includes a
short one (``tests/e2e/test_soak.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from nats.aio.client import Client
from redis.asyncio import Redis

from xpupool.client import XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    CancelReply,
    DeviceDemand,
    GangSpec,
    JobPending,
    JobRequested,
    LeaseEnded,
    LeaseEnding,
    LeaseRenewed,
    LeaseReply,
    decoder_for,
    subjects,
)
from xpupool.devstack.invariants import (
    FIRST_OUTCOMES,
    Violation,
    check_fencing,
    check_grants_recorded,
    check_no_double_allocation,
    check_nothing_leaked,
    check_outcomes,
    check_quota,
    check_tenant_delivery,
)
from xpupool.devstack.stack import NodeSpec, ServiceProcess, Stack
from xpupool.lease_manager.metrics import OUTBOXES
from xpupool.ledger import Ledger, audit
from xpupool.ledger.ledger import LeaseRecord
from xpupool.obs.failpoints import POINTS

FAMILIES = ("kill", "pause", "restart", "failpoint")
NODES = 4
DEVICES_PER_NODE = 4
TENANTS = ("alpha", "beta")
#: A tenant that sends only what it must be refused: commands on other tenants' leases (with
#: their secrets, as if stolen), cancels of their jobs, requests in their name.
INTRUDER = "mallory"
#: The queues (``XPUPOOL_QUEUE_CONFIG``): alpha is guaranteed more than half the pool and may
#: take idle capacity back from beta, whose limit is I4's bound; preemption at any age.
QUEUES: dict[str, Any] = {
    "queues": [
        {"name": "alpha", "guaranteed": {"units": 10}},
        {"name": "beta", "limit": {"units": 6}},
    ],
    "preemption": {"enabled": True, "min_runtime_s": 0},
}
LIMITS_UNITS = {"beta": 6.0}
LEASE_TTL_S = 10.0
PROBES = 30
# What the invariants read of the stream: the jobs' first outcomes and the leases' ends.
_STORED = decoder_for((*FIRST_OUTCOMES, LeaseEnded))
# What a tenant's subjects carry.
_DELIVERED = decoder_for((*FIRST_OUTCOMES, JobPending, LeaseRenewed, LeaseEnding, LeaseEnded))


@dataclass
class History:
    """What the workers saw: every job they submitted, by what became of the submit."""

    accepted: set[str] = field(default_factory=set)
    uncertain: set[str] = field(default_factory=set)  # the submit failed: maybe admitted
    seen: Counter[str] = field(default_factory=Counter)  # first outcomes as the clients saw them
    unanswered: int = 0  # accepted, and no outcome seen within the client's wait
    releases_failed: int = 0  # left to expire
    owners: dict[str, str] = field(default_factory=dict)  # job -> the tenant that submitted it
    held: dict[str, AllocationGranted] = field(default_factory=dict)  # grants not yet released
    # I5 and I6 as the clients saw them: commands that must be refused, by how they were
    # answered, and each one that was carried out instead.
    refusals: Counter[str] = field(default_factory=Counter)
    breaches: list[Violation] = field(default_factory=list)
    delivered: list[tuple[str, object]] = field(default_factory=list)  # (subject's tenant, event)
    undecodable: int = 0  # messages on a tenant's event subjects that are no event


@dataclass
class Report:
    minutes: float
    seed: int
    faults: list[str]
    jobs: int
    accepted: int
    uncertain: int
    seen: dict[str, int]
    unanswered: int
    releases_failed: int
    refusals: dict[str, int]
    events_delivered: int
    deliveries_undecodable: int  # on a tenant's event subjects, no event this soak knows
    leases: int
    lease_ends: dict[str, int]  # by reason, as the stream stored them
    events_stored: int
    recovery_s: float | None
    quiet_s: float
    violations: list[str]


def _request(rng: random.Random, job_id: str, tenant: str) -> tuple[JobRequested, str]:
    """One job of the mix, and what the worker does with it."""
    kind = rng.choices(
        ["whole", "share", "gang", "too_large", "short_wait", "cancel"], [4, 4, 2, 1, 1, 1]
    )[0]
    base = JobRequested(job_id=job_id, tenant=tenant, lease_ttl_s=LEASE_TTL_S)
    memory_mib = rng.choice([8_000, 20_000, 40_000])
    shaped: dict[str, dict[str, Any]] = {
        "share": {"device": DeviceDemand(memory_mib=memory_mib)},
        "gang": {"count": 2, "gang": GangSpec(same_node=True)},
        "too_large": {"count": NODES * DEVICES_PER_NODE * 4},
        "short_wait": {
            "count": DEVICES_PER_NODE,
            "gang": GangSpec(same_node=True),
            "max_wait_s": 0.3,
        },
    }
    request = msgspec.structs.replace(base, **shaped.get(kind, {}))
    return request, kind


async def _must_refuse(
    history: History,
    invariant: str,
    subject: str,
    what: str,
    command: Awaitable[LeaseReply | CancelReply],
) -> None:
    """Send a command that must be refused (I5, I6); one carried out is a breach. One that got no
    answer (a fault) proves nothing either way and is counted as such."""
    try:
        reply = await command
    except Exception:  # noqa: BLE001  (a service or server away)
        history.refusals[f"{invariant} unanswered"] += 1
        return
    if reply.ok:
        history.breaches.append(Violation(invariant, subject, f"{what} was carried out"))
    else:
        history.refusals[f"{invariant} {reply.error}"] += 1


async def _hold_and_release(
    client: XpupoolClient, grant: AllocationGranted, rng: random.Random, history: History
) -> None:
    lease_id, token = grant.lease_id, grant.fencing_token
    history.held[lease_id] = grant
    await asyncio.sleep(rng.uniform(0.05, 1.0))
    if rng.random() < 0.3:
        # A renewal that fails (a fault) leaves the release below, or the expiry, to end it.
        with suppress(Exception):
            await client.renew(lease_id, token)
    if rng.random() < 0.1:
        older = client.renew(lease_id, token - 1)
        await _must_refuse(history, "I5", lease_id, f"a renew with token {token - 1}", older)
    released = False
    for attempt in range(3):
        try:
            reply = await client.release(lease_id, token)
        except Exception:  # noqa: BLE001  (its lease-manager or NATS away: try again)
            await asyncio.sleep(0.5 * (attempt + 1))
            continue
        released = reply.ok or reply.error == "lease_ended"
        break
    history.held.pop(lease_id, None)
    if not released:
        history.releases_failed += 1
    elif rng.random() < 0.2:
        # The holder's own command once more, after the end: a token that is no longer current.
        again = client.release(lease_id, token)
        await _must_refuse(history, "I5", lease_id, "a release after the lease ended", again)
        late = client.renew(lease_id, token)
        await _must_refuse(history, "I5", lease_id, "a renew after the lease ended", late)


async def _worker(
    client: XpupoolClient,
    name: str,
    tenant: str,
    rng: random.Random,
    history: History,
    stop: asyncio.Event,
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        request, kind = _request(rng, f"{name}-{n:06d}", tenant)
        history.owners[request.job_id] = tenant
        try:
            if kind == "cancel":
                future = await client.submit_expecting(request)
                history.accepted.add(request.job_id)
                with suppress(Exception):  # the job then runs its course
                    await client.cancel(request.job_id)
                outcome = await asyncio.wait_for(future, 45)
            else:
                outcome = await client.submit_and_wait(request, timeout_s=45)
                history.accepted.add(request.job_id)
        except TimeoutError:
            # Submitted (the wait starts once the request is in), no outcome seen in time.
            history.accepted.add(request.job_id)
            history.unanswered += 1
            continue
        except Exception:  # noqa: BLE001  (NATS away: admitted or not, nobody knows)
            history.uncertain.add(request.job_id)
            await asyncio.sleep(0.2)
            continue
        history.seen[type(outcome).__name__] += 1
        if isinstance(outcome, AllocationGranted):
            await _hold_and_release(client, outcome, rng, history)


async def _intruder(
    client: XpupoolClient, rng: random.Random, history: History, stop: asyncio.Event
) -> None:
    """I6's hostile tenant: on its own subjects (all its credentials would allow), commands on
    the other tenants' leases and jobs, each of which must be refused, and requests in another
    tenant's name, which must be rejected."""
    n = 0
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        action = rng.choice(["release", "renew", "cancel", "impersonate"])
        if action in ("release", "renew") and history.held:
            grant = rng.choice(list(history.held.values()))
            # With the grant's own secret and token, as if they had leaked.
            command = (client.release if action == "release" else client.renew)(
                grant.lease_id, grant.fencing_token, secret=grant.lease_secret
            )
            what = f"{INTRUDER}'s {action} of {grant.tenant}'s lease"
            await _must_refuse(history, "I6", grant.lease_id, what, command)
        elif action == "cancel" and history.owners:
            job_id = rng.choice(list(history.owners)[-200:])
            what = f"{INTRUDER}'s cancel of {history.owners[job_id]}'s job"
            await _must_refuse(history, "I6", job_id, what, client.cancel(job_id))
        elif action == "impersonate":
            n += 1
            request = JobRequested(job_id=f"{INTRUDER}-{n:06d}", tenant=rng.choice(TENANTS))
            history.owners[request.job_id] = INTRUDER
            reply = None
            with suppress(Exception):
                reply = await client.submit_request(request)
            if reply is None:
                history.uncertain.add(request.job_id)  # may have been admitted (and rejected)
                continue
            history.accepted.add(request.job_id)
            if reply.rejected is None:
                history.breaches.append(
                    Violation(
                        "I6", request.job_id, f"a request in {request.tenant}'s name: {reply.state}"
                    )
                )
            else:
                history.refusals[f"I6 {reply.rejected.reason}"] += 1


async def _record_deliveries(nc: Client, history: History) -> None:
    """Keep what each tenant's event subjects carry (I6), with the tenant the subject names."""
    prefix = len(subjects.TENANT_SPACE) + 1

    async def keep(msg: Any) -> None:
        tenant = msg.subject[prefix:].split(".", 1)[0]
        try:
            history.delivered.append((tenant, _DELIVERED.decode(msg.data)))
        except msgspec.DecodeError:
            history.undecodable += 1

    await nc.subscribe(f"{subjects.TENANT_SPACE}.*.events.>", cb=keep)


class Faults:
    """Injects one fault at a time into ``stack`` (see the module docstring)."""

    def __init__(self, stack: Stack, rng: random.Random, families: Sequence[str]) -> None:
        self.stack = stack
        self.rng = rng
        self.families = list(families)
        self._deck: list[str] = []
        self.log: list[str] = []

    def _service(self, name: str) -> ServiceProcess:
        choices = [s for s in self.stack.services if s.name == name]
        return self.rng.choice(choices)

    async def _kill(self) -> str:
        name = self.rng.choice(["scheduler", "lease-manager", "telemetry-collector"])
        service = self._service(name)
        self.stack.kill(service)
        down_s = self.rng.uniform(0, 1.5)
        await asyncio.sleep(down_s)
        self.stack.restart(service)
        return f"kill {name} (down {down_s:.1f} s)"

    async def _pause(self) -> str:
        # A server, or a service as a long garbage collection or an overloaded host stops it:
        # its connections stay open and everything sent to it waits.
        name = self.rng.choice(["nats", "redis", "scheduler", "lease-manager"])
        if name in ("nats", "redis"):
            pid = getattr(self.stack, name).process.pid
        else:
            pid = self._service(name).process.pid
        pause_s = self.rng.uniform(0.3, 3.0)
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(pause_s)
        finally:
            os.kill(pid, signal.SIGCONT)
        return f"pause {name} {pause_s:.1f} s"

    async def _restart(self) -> str:
        server = self.rng.choice(["nats", "redis"])
        await asyncio.to_thread(getattr(self.stack, server).restart)
        return f"restart {server}"

    async def _failpoint(self) -> str:
        point = self.rng.choice(sorted(POINTS))
        name = point.split(".")[0].replace("_", "-")
        if self.rng.random() < 0.5:
            # A stall at the point (the process alive, its connections open, nothing served)
            # for its next three passes, then the service started again clean.
            service = self.stack.restart(
                self._service(name), XPUPOOL_FAILPOINTS=f"{point}=3*stall(1000)"
            )
            await asyncio.sleep(6.0)
            self.stack.restart(service, XPUPOOL_FAILPOINTS="")
            return f"failpoint {point}: stalls of 1 s for 6 s"
        service = self.stack.restart(self._service(name), XPUPOOL_FAILPOINTS=f"{point}=1*kill")
        for _ in range(200):  # 10 s
            if not service.alive():
                break
            await asyncio.sleep(0.05)
        fired = not service.alive()
        self.stack.restart(service, XPUPOOL_FAILPOINTS="")
        return f"failpoint {point}: {'died there' if fired else 'not reached in 10 s'}"

    async def inject(self) -> None:
        # Each family once per round, in an order the seed shuffles: a short run sees them all.
        if not self._deck:
            self._deck = self.rng.sample(self.families, len(self.families))
        family = self._deck.pop()
        act: Callable[[], Awaitable[str]] = getattr(self, f"_{family}")
        started = time.monotonic()
        what = await act()
        line = f"{time.strftime('%H:%M:%S')} {what} ({time.monotonic() - started:.1f} s)"
        self.log.append(what)
        print(line, flush=True)


async def _stored_events(nc: Client) -> list[tuple[str, object]]:
    """The first outcomes and lease ends the operator's stream holds, with their ids, in stored
    order."""
    js = nc.jetstream()
    stream = subjects.EVENTS_STREAM.name
    state = (await js.stream_info(stream)).state
    stored: list[tuple[str, object]] = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except Exception:  # noqa: BLE001  (a deleted sequence: none of ours)
            continue
        try:
            event = _STORED.decode(msg.data or b"")
        except Exception:  # noqa: BLE001  (node and scale events: not job history)
            continue
        stored.append(((msg.headers or {}).get("Nats-Msg-Id", ""), event))
    return stored


async def _all_leases(ledger: Ledger) -> list[LeaseRecord]:
    """Every lease record the ledger keeps, live and ended."""
    prefix = ledger.key("lease", "")
    ids = [
        key.decode()[len(prefix) :]
        async for key in ledger.redis.scan_iter(match=prefix + "*", count=1000)
    ]
    records = await ledger.get_leases(ids) if ids else []
    return [r for r in records if r is not None]


async def _wait_quiet(ledger: Ledger, timeout_s: float) -> float:
    """Seconds until no job waits, no lease is live and the outboxes are empty."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            live = await ledger.leases()
            pending = await ledger.pending_jobs()
            outboxes = [await ledger.redis.xlen(ledger.key("outbox", name)) for name in OUTBOXES]
        except Exception:  # noqa: BLE001  (Redis coming back)
            await asyncio.sleep(0.5)
            continue
        if not live and not pending and not any(outboxes):
            return time.monotonic() - started
        await asyncio.sleep(0.5)
    return time.monotonic() - started


async def _recovery(client: XpupoolClient) -> float | None:
    """Seconds until a probe job is granted once the faults stopped (I7), None if never."""
    started = time.monotonic()
    for n in range(PROBES):
        try:
            probe = JobRequested(job_id=f"probe-{n}", tenant=TENANTS[0], lease_ttl_s=LEASE_TTL_S)
            outcome = await client.submit_and_wait(probe, timeout_s=5)
        except Exception:  # noqa: BLE001  (not back yet)
            await asyncio.sleep(0.5)
            continue
        if isinstance(outcome, AllocationGranted):
            await client.release(outcome.lease_id, outcome.fencing_token)
            return time.monotonic() - started
    return None


async def soak(
    minutes: float,
    seed: int,
    workers: int = 8,
    fault_every_s: float = 15.0,
    families: Sequence[str] = FAMILIES,
    replicas: int = 1,
    secure: bool = False,
) -> Report:
    """Run the soak (see the module docstring) and check its invariants."""
    rng = random.Random(seed)
    workdir = Path(tempfile.mkdtemp(prefix="xpupool-soak-"))
    queues = workdir / "queues.yaml"
    queues.write_text(yaml.safe_dump(QUEUES))
    stack = Stack(
        [NodeSpec(f"soak-{i}", f"{DEVICES_PER_NODE}xA100-80GB") for i in range(NODES)],
        workdir=workdir,
        schedulers=replicas,
        extra_env={"XPUPOOL_QUEUE_CONFIG": str(queues)},
        secure=secure,
        tenants=(*TENANTS, INTRUDER),
    )
    history = History()
    duration_s = minutes * 60
    quiet_tail_s = max(10.0, duration_s / 5)
    await asyncio.to_thread(stack.start)
    for _ in range(replicas - 1):
        stack.spawn("lease-manager")
    try:
        assert stack.redis_url and stack.nats_url
        redis = Redis.from_url(stack.redis_url)
        ledger = Ledger(redis, stack.namespace)
        for _ in range(300):  # a minute for the collectors to register
            if sum(len(n.devices) for n in await ledger.nodes()) >= NODES * DEVICES_PER_NODE:
                break
            await asyncio.sleep(0.2)
        await stack.wait_until_pulling()
        async with AsyncExitStack() as exits:
            clients = {
                tenant: await exits.enter_async_context(
                    stack.client(tenant, max_reconnect_attempts=-1)
                )
                for tenant in (*TENANTS, INTRUDER)
            }
            # The operator's connection: every tenant's events, and the operator's stream.
            operator = await stack.connect_operator(max_reconnect_attempts=-1)
            exits.push_async_callback(operator.close)
            await _record_deliveries(operator, history)
            stop = asyncio.Event()
            tasks = [
                asyncio.create_task(
                    _worker(
                        clients[TENANTS[i % len(TENANTS)]],
                        f"w{i}",
                        TENANTS[i % len(TENANTS)],
                        random.Random(rng.random()),
                        history,
                        stop,
                    )
                )
                for i in range(workers)
            ]
            tasks.append(
                asyncio.create_task(
                    _intruder(clients[INTRUDER], random.Random(rng.random()), history, stop)
                )
            )
            faults = Faults(stack, random.Random(rng.random()), families)
            started = time.monotonic()
            next_fault = started + fault_every_s
            while time.monotonic() - started < duration_s - quiet_tail_s:
                await asyncio.sleep(max(0.0, min(next_fault - time.monotonic(), 1.0)))
                if time.monotonic() >= next_fault:
                    await faults.inject()
                    next_fault = time.monotonic() + fault_every_s
            recovery_s = await _recovery(clients[TENANTS[0]])
            await asyncio.sleep(max(0.0, duration_s - (time.monotonic() - started)))
            stop.set()
            await asyncio.gather(*tasks)
            quiet_s = await _wait_quiet(ledger, timeout_s=120)
            await asyncio.sleep(1.0)  # anything still on its way is stored by now
            stored = await _stored_events(operator)
        leases = await _all_leases(ledger)
        nodes = await ledger.nodes()
        capacity = {d.spec.device_id: d.memory_total_mib for n in nodes for d in n.devices}
        # The probes' submits may have failed while the stack came back: each has at most one.
        probes = {f"probe-{n}" for n in range(PROBES)}
        violations: list[Violation] = [
            *check_outcomes(history.accepted, history.uncertain | probes, stored),
            *check_no_double_allocation(leases, capacity),
            *check_fencing(leases),
            *check_grants_recorded(stored, leases),
            *check_nothing_leaked(leases, nodes),
            *check_quota(leases, LIMITS_UNITS, capacity),
            *history.breaches,
            *check_tenant_delivery(history.delivered, history.owners),
        ]
        if history.undecodable:
            violations.append(
                Violation(
                    "contract",
                    f"{subjects.TENANT_SPACE}.*.events.>",
                    f"{history.undecodable} messages that decode as no tenant event",
                )
            )
        audit_problems = await audit(ledger)
        await redis.aclose()
        return Report(
            minutes=minutes,
            seed=seed,
            faults=faults.log,
            jobs=len(history.accepted) + len(history.uncertain),
            accepted=len(history.accepted),
            uncertain=len(history.uncertain),
            seen=dict(history.seen),
            unanswered=history.unanswered,
            releases_failed=history.releases_failed,
            refusals=dict(history.refusals),
            events_delivered=len(history.delivered),
            deliveries_undecodable=history.undecodable,
            leases=len(leases),
            lease_ends=dict(
                Counter(str(e.reason) for _, e in dict(stored).items() if isinstance(e, LeaseEnded))
            ),
            events_stored=len(stored),
            recovery_s=recovery_s,
            quiet_s=quiet_s,
            violations=[str(v) for v in violations] + [f"audit: {p}" for p in audit_problems],
        )
    finally:
        await asyncio.to_thread(stack.stop)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--fault-every-s", type=float, default=15.0)
    parser.add_argument("--faults", default=",".join(FAMILIES))
    parser.add_argument("--replicas", type=int, default=1, help="schedulers and lease-managers")
    parser.add_argument(
        "--secure",
        action="store_true",
        help="TLS, each tenant and service with its own credentials, Redis ACLs",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    families = [f for f in args.faults.split(",") if f]
    unknown = set(families) - set(FAMILIES)
    if unknown or not families:
        parser.error(f"--faults takes some of {', '.join(FAMILIES)}")
    if args.replicas < 1:
        parser.error("--replicas takes 1 or more")
    report = asyncio.run(
        soak(
            args.minutes,
            args.seed,
            args.workers,
            args.fault_every_s,
            families,
            args.replicas,
            args.secure,
        )
    )
    print(
        f"\n{report.jobs} jobs ({report.accepted} accepted, {report.uncertain} submits failed), "
        f"first outcomes seen {report.seen}, {report.unanswered} unanswered in 45 s, "
        f"{report.releases_failed} releases left to expiry; {len(report.faults)} faults; "
        f"commands that must be refused: {report.refusals}; "
        f"{report.events_delivered} tenant events recorded "
        f"({report.deliveries_undecodable} other messages); "
        f"{report.leases} leases (ended {report.lease_ends}), {report.events_stored} events "
        f"stored; first grant "
        f"{report.recovery_s if report.recovery_s is None else round(report.recovery_s, 2)} s "
        f"after the faults; quiet after {report.quiet_s:.1f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2))
    if report.violations:
        print(f"{len(report.violations)} violations:")
        for line in report.violations:
            print(f"  {line}")
        return 1
    print("invariants I1 to I6 and the ledger audit: no violation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
