"""The autoscaler as a running service, on real servers with the whole stack.

Replicas run as their own processes (``python replica.py``: ``xpupool.autoscaler.main.run``
with an injected solver and a collector launcher that can delay a node's start, so a test can
kill a leader while its nodes are still provisioning). Pools use the simulated provider: each
node is a telemetry-collector process with the simulated backend.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.autoscaler.providers.simulated import stop_recorded_nodes
from xpupool.autoscaler.state import AutoscalerState, LostLeadership
from xpupool.autoscaler.status import ScaleStatus, decode_status
from xpupool.bus import round_trip
from xpupool.bus.lifecycle import PARENT_PID_ENV
from xpupool.contracts import (
    AllocationGranted,
    GangSpec,
    JobReason,
    JobRejected,
    JobRequested,
    NodeDraining,
    NodeProvisioning,
    NodeReady,
    NodeRemoved,
    ScaleAction,
    ScaleDecision,
    ScaleFailed,
    ScaleReason,
    decoder_for,
)
from xpupool.devstack.servers import free_port
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
T = TypeVar("T")

MODEL = "A100-SXM4-80GB"

REPLICA = """
import asyncio, json, math, os, sys

from xpupool.autoscaler.main import run
from xpupool.autoscaler.providers.simulated import CollectorLauncher
from xpupool.autoscaler.settings import AutoscalerSettings
from xpupool.autoscaler.solver import PoolAddition, ScaleUpAnswer
from xpupool.obs import load_settings


class FakeSolver:
    # Every pending (whole-device) job goes to the first pool; incoming nodes serve first.
    def solve(self, problem):
        pool = problem.pools[0]
        per = pool.node.count
        incoming = sum(1 for n in problem.incoming if n.pool == pool.name)
        jobs = [j.job_id for j in problem.pending]
        served = {j: pool.name for j in jobs[: incoming * per]}
        rest = jobs[incoming * per:]
        need = min(math.ceil(len(rest) / per), problem.room.get(pool.name, 0))
        additions = (PoolAddition(pool.name, need, tuple(rest[: need * per])),) if need else ()
        return ScaleUpAnswer(additions, served, {j: "at max_size" for j in rest[need * per:]})


delay = float(os.environ.get("TEST_COLLECTOR_DELAY_S", "0"))
command = ["sh", "-c", f'sleep {delay}; exec "$0" -m xpupool.telemetry_collector', sys.executable]
# On a secure stack the collectors run with their own identity, as the service's default does.
identity = json.loads(os.environ.get("XPUPOOL_AUTOSCALER_COLLECTOR_ENV") or "{}")
launcher = CollectorLauncher(
    os.environ["TEST_COLLECTOR_LOGS"], command=command, base_env={**os.environ, **identity}
)
solver = FakeSolver() if os.environ.get("TEST_SOLVER") == "fake" else None
asyncio.run(run(load_settings(AutoscalerSettings), solver=solver, launcher=launcher))
"""

ScaleEvent = ScaleDecision | NodeProvisioning | NodeReady | NodeDraining | NodeRemoved | ScaleFailed


class ScaleLog:
    """Every ``xpupool.scale.v1.*`` event, decoded, in arrival order (core NATS: a replayed
    event arrives again, JetStream keeps it once)."""

    def __init__(self) -> None:
        self.events: list[ScaleEvent] = []
        self._decoder: Any = decoder_for(
            (ScaleDecision, NodeProvisioning, NodeReady, NodeDraining, NodeRemoved, ScaleFailed)
        )

    async def attach(self, nc: Client) -> None:
        async def on_message(msg: Msg) -> None:
            self.events.append(self._decoder.decode(msg.data))

        await nc.subscribe("xpupool.scale.v1.>", cb=on_message)
        await round_trip(nc)

    def of(self, kind: type[T]) -> list[T]:
        return [e for e in self.events if isinstance(e, kind)]

    def decisions(self, action: ScaleAction) -> dict[str, ScaleDecision]:
        return {d.decision_id: d for d in self.of(ScaleDecision) if d.action is action}


class Replicas:
    """Autoscaler replica processes on one stack."""

    def __init__(self, stack: Stack, workdir: Path, pools_file: Path) -> None:
        self.stack = stack
        self.workdir = workdir
        self.pools_file = pools_file
        self.script = workdir / "replica.py"
        self.script.write_text(REPLICA)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str, **env: str) -> None:
        port = free_port()
        environ = {
            **self.stack.service_env("autoscaler"),
            PARENT_PID_ENV: str(os.getpid()),
            "XPUPOOL_POOLS_FILE": str(self.pools_file),
            "XPUPOOL_AUTOSCALER_REPLICA_ID": name,
            "XPUPOOL_AUTOSCALER_INTERVAL_S": "0.5",
            "XPUPOOL_AUTOSCALER_LEADER_TTL_S": "3",
            "XPUPOOL_AUTOSCALER_SETTLE_S": "5",
            "XPUPOOL_AUTOSCALER_METRICS_PORT": str(port),
            "TEST_COLLECTOR_LOGS": str(self.workdir / "nodes"),
            **env,
        }
        with (self.workdir / f"autoscaler-{name}.log").open("ab") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, str(self.script)],
                env=environ,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.ports[name] = port

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self.processes.clear()

    def metrics(self, name: str) -> str:
        url = f"http://127.0.0.1:{self.ports[name]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310  (loopback)
            return str(answer.read().decode())

    def logs(self) -> str:
        return "\n".join(
            f"===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.workdir.glob("autoscaler-*.log"))
        )


def pools_yaml(state_dir: Path, pools: list[tuple[str, float, int]], cooldown_s: float) -> str:
    entries = []
    for name, cost, max_size in pools:
        entries.append(
            f"""  - name: {name}
    node: {{model: {MODEL}, count: 2, cpu_milli: 64000, memory_mib: 524288}}
    cost_per_hour: {cost}
    min_size: 0
    max_size: {max_size}
    provisioning_delay_s: 2
    scale_down: {{cooldown_s: {cooldown_s}, low_watermark: 1.0}}
    provider: {{type: simulated, state_dir: {state_dir}}}
"""
        )
    return "pools:\n" + "".join(entries)


Start = Callable[..., tuple[Stack, Replicas, Path]]


@pytest.fixture
def autoscaling(make_stack: Callable[..., Stack], tmp_path: Path) -> Iterator[Start]:
    """``start(pools, cooldown_s, devices=1, queues="")``: a stack with one static node
    (``devices`` A100s; the scheduler on the ``queues`` file if given) and a pool file of
    simulated pools; the replicas are started by the test. Every node the replicas started is
    stopped afterwards."""
    state_dir = tmp_path / "simulated"
    started: list[Replicas] = []

    def start(
        pools: list[tuple[str, float, int]], cooldown_s: float, devices: int = 1, queues: str = ""
    ) -> tuple[Stack, Replicas, Path]:
        options: dict[str, object] = {}
        if queues:
            (tmp_path / "queues.yaml").write_text(queues)
            options["extra_env"] = {"XPUPOOL_QUEUE_CONFIG": str(tmp_path / "queues.yaml")}
        stack = make_stack([NodeSpec("static-1", f"{devices}x{MODEL}")], **options)
        pools_file = tmp_path / "pools.yaml"
        pools_file.write_text(pools_yaml(state_dir, pools, cooldown_s))
        workdir = tmp_path / "autoscalers"
        workdir.mkdir(exist_ok=True)
        replicas = Replicas(stack, workdir, pools_file)
        started.append(replicas)
        return stack, replicas, state_dir

    yield start
    for replicas in started:
        replicas.stop()
    stop_recorded_nodes(state_dir, timeout_s=5)


async def status_of(ledger: Ledger) -> ScaleStatus | None:
    raw = await ledger.redis.get(ledger.key("autoscaler", "status"))
    if raw is None:
        return None
    return decode_status(raw if isinstance(raw, bytes) else raw.encode())


def pool_of(status: ScaleStatus, name: str) -> Any:
    return next(p for p in status.pools if p.name == name)


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        XPUPOOL_NATS_URL=stack.nats_url or "",
        XPUPOOL_REDIS_URL=stack.redis_url or "",
        XPUPOOL_NAMESPACE=stack.namespace,
    )
    return subprocess.run(
        [sys.executable, "-m", "xpupool.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def job(job_id: str) -> JobRequested:
    return JobRequested(job_id=job_id, tenant="team-a", lease_ttl_s=600)


async def test_a_burst_grows_the_cheapest_pool_and_idle_nodes_go_after_the_cool_down(
    autoscaling: Start, ready: Ready
) -> None:
    """Two replicas, one acts. Pending requests beyond the fleet make it add the cheapest pool's
    nodes (real placement solver), announced with reasons; they become ready (NodeReady) only
    once registered, and the requests are granted there. ``xpupool scale status`` and the
    metrics show it. Idle nodes are drained and removed after the cool-down; one holding a
    lease is kept until its lease ends."""
    stack, replicas, state_dir = autoscaling([("ondemand", 20.0, 3), ("spot", 4.0, 3)], 3.0)
    ledger = await ready(stack, 1)
    log = ScaleLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        replicas.start("a")
        replicas.start("b")

        async def leader() -> str | None:
            status = await status_of(ledger)
            return status.leader if status else None

        acting = await eventually(leader, timeout_s=30)
        assert acting is not None
        follower = "b" if acting == "a" else "a"
        first = await client.submit_and_wait(job("job-0"))
        assert isinstance(first, AllocationGranted), first
        assert first.slices[0].node_id == "static-1"

        futures = {f"job-{i}": client.expect(f"job-{i}") for i in range(1, 5)}
        for job_id in futures:
            await client.submit(job(job_id))
        try:
            grants = {j: await asyncio.wait_for(f, timeout=60) for j, f in futures.items()}
        except TimeoutError:
            pytest.fail(f"not granted; events {log.events}\n{replicas.logs()}\n{stack.logs()}")
        assert all(isinstance(g, AllocationGranted) for g in grants.values()), grants

        # One scale-up of the cheap pool, two nodes for four devices, with its reason and demand.
        ups = list(log.decisions(ScaleAction.SCALE_UP).values())
        assert len(ups) == 1, ups
        up = ups[0]
        assert (up.pool, up.reason, up.count) == ("spot", ScaleReason.PENDING_DEMAND, 2), up
        assert set(up.demand.job_ids) == set(futures) and up.demand.devices == 4
        assert (up.size_before, up.size_after, up.cost_per_hour_delta) == (0, 2, 8.0)
        provisioning = log.of(NodeProvisioning)
        assert {p.request_id for p in provisioning} == {up.decision_id}
        spot_nodes = set(provisioning[0].node_ids)
        assert spot_nodes == {"spot-1", "spot-2"}
        await eventually(lambda: {r.node_id for r in log.of(NodeReady)} == spot_nodes)
        # The new nodes serve the burst; each was announced ready after it was asked for.
        order = log.events
        for g in grants.values():
            assert isinstance(g, AllocationGranted)
            assert g.slices[0].node_id in spot_nodes
        for ready_event in log.of(NodeReady):
            assert order.index(ready_event) > order.index(provisioning[0])
            assert ready_event.request_id == up.decision_id
        assert {n.node_id for n in await ledger.nodes()} >= spot_nodes

        # Status (CLI) and metrics.
        async def settled() -> ScaleStatus | None:
            status = await status_of(ledger)
            if status and pool_of(status, "spot").ready == 2 and not status.pending.jobs:
                return status
            return None

        status = await eventually(settled, timeout_s=20)
        assert status is not None
        assert status.leader == acting and status.cost_per_hour == 8.0
        shown = cli(stack, "scale", "status")
        assert shown.returncode == 0, shown.stderr
        assert f"autoscaler {acting}" in shown.stdout
        spot_line = next(line for line in shown.stdout.splitlines() if line.startswith("spot "))
        assert spot_line.split()[3:9] == ["0", "3", "2", "0", "0", "0"], spot_line
        as_json = json.loads(cli(stack, "scale", "status", "--json").stdout)
        assert pool_of(decode_status(json.dumps(as_json).encode()), "spot").ready == 2
        metrics = await asyncio.to_thread(replicas.metrics, acting)
        assert "xpupool_autoscaler_leader 1.0" in metrics
        assert 'xpupool_autoscaler_pool_nodes{pool="spot",state="ready"} 2.0' in metrics
        assert 'xpupool_autoscaler_pool_nodes{pool="ondemand",state="ready"} 0.0' in metrics
        assert 'xpupool_autoscaler_pool_cost_per_hour{pool="spot"} 8.0' in metrics
        assert 'xpupool_autoscaler_pool_size_limit{bound="max",pool="spot"} 3.0' in metrics
        assert "xpupool_autoscaler_pending_demand_devices 0.0" in metrics
        assert (
            'xpupool_autoscaler_decisions_total{action="scale_up",reason="pending_demand"} 1.0'
            in metrics
        )
        other = await asyncio.to_thread(replicas.metrics, follower)
        assert "xpupool_autoscaler_leader 0.0" in other
        assert 'pool="spot"' not in other

        # Scale-down: empty one node, keep one lease on the other.
        by_node: dict[str, list[AllocationGranted]] = {}
        for g in grants.values():
            assert isinstance(g, AllocationGranted)
            by_node.setdefault(g.slices[0].node_id, []).append(g)
        emptied, kept = sorted(by_node, key=lambda n: len(by_node[n]))[::-1]
        if len(by_node[emptied]) < len(by_node[kept]):
            emptied, kept = kept, emptied
        for g in by_node[emptied]:
            assert (await client.release(g.lease_id, g.fencing_token)).ok
        for g in by_node[kept][1:]:
            assert (await client.release(g.lease_id, g.fencing_token)).ok
        holder = by_node[kept][0]

        await eventually(lambda: emptied in {r.node_id for r in log.of(NodeRemoved)}, timeout_s=40)
        drains = list(log.decisions(ScaleAction.DRAIN).values())
        assert drains and all(d.reason is ScaleReason.IDLE for d in drains), drains
        assert {n for d in drains for n in d.node_ids} == {emptied}
        removes = list(log.decisions(ScaleAction.REMOVE).values())
        assert [(r.reason, r.node_ids) for r in removes] == [(ScaleReason.DRAINED, [emptied])]
        await asyncio.sleep(4)  # longer than the cool-down: the leased node stays
        assert kept not in {e.node_id for e in log.of(NodeDraining)}
        assert not (state_dir / "pools" / "spot" / f"{emptied}.json").exists()
        assert (state_dir / "pools" / "spot" / f"{kept}.json").exists()

        assert (await client.release(holder.lease_id, holder.fencing_token)).ok
        await eventually(lambda: kept in {r.node_id for r in log.of(NodeRemoved)}, timeout_s=40)
        assert not list((state_dir / "pools" / "spot").glob("*.json"))
        assert not log.of(ScaleFailed), log.of(ScaleFailed)
        assert not {d.pool for d in log.of(ScaleDecision)} - {"spot"}


async def test_a_replica_takes_over_mid_provisioning_without_provisioning_twice(
    autoscaling: Start, ready: Ready
) -> None:
    """The leader is SIGKILLed while its nodes are still starting; the second replica takes the
    lease, replays the journal with the same request id (the provider changes nothing), marks
    the nodes ready when they register, and the pending requests are granted: one node, one
    provider request."""
    stack, replicas, state_dir = autoscaling([("spot", 4.0, 3)], 60.0)
    ledger = await ready(stack, 1)
    log = ScaleLog()
    delay = {"TEST_SOLVER": "fake", "TEST_COLLECTOR_DELAY_S": "6"}
    async with stack.client() as client:
        await log.attach(client.nc)
        replicas.start("a", **delay)

        async def leader() -> str | None:
            status = await status_of(ledger)
            return status.leader if status else None

        assert await eventually(leader, timeout_s=30) == "a"
        replicas.start("b", **delay)
        first = await client.submit_and_wait(job("job-0"))
        assert isinstance(first, AllocationGranted), first
        futures = {f"job-{i}": client.expect(f"job-{i}") for i in (1, 2)}
        for job_id in futures:
            await client.submit(job(job_id))

        provisioning = await eventually(lambda: log.of(NodeProvisioning), timeout_s=30)
        replicas.kill("a")  # its node's collector is still sleeping: mid-provisioning
        assert not log.of(NodeReady)
        request = provisioning[0].request_id
        assert provisioning[0].node_ids == ["spot-1"]
        registered = {n.node_id for n in await ledger.nodes()}
        assert "spot-1" not in registered, "the node registered before the kill"

        async def b_leads() -> bool:
            status = await status_of(ledger)
            return status is not None and status.leader == "b"

        await eventually(b_leads, timeout_s=20)

        # While the node is still on its way, the ledger says which jobs it is for (what a
        # scheduler that restarted reads), and the scheduler has them wait capacity_incoming.
        async def incoming() -> bool:
            now_s = await ledger.now_ms() / 1000
            return set(futures) <= await ledger.incoming_jobs(now_s)

        async def waiting_for_it() -> bool:
            reasons = {job.job_id: job.reason for _, job in await ledger.pending_jobs()}
            return all(reasons.get(j) == "capacity_incoming" for j in futures)

        assert await eventually(incoming, timeout_s=10)
        assert await eventually(waiting_for_it, timeout_s=10)
        try:
            grants = {j: await asyncio.wait_for(f, timeout=40) for j, f in futures.items()}
        except TimeoutError:
            pytest.fail(f"not granted; events {log.events}\n{replicas.logs()}\n{stack.logs()}")
        assert all(
            isinstance(g, AllocationGranted) and g.slices[0].node_id == "spot-1"
            for g in grants.values()
        ), grants

        # One decision, one provider request, one node: B replayed A's request id.
        ups = log.decisions(ScaleAction.SCALE_UP)
        assert list(ups) == [request], ups
        assert {p.request_id for p in log.of(NodeProvisioning)} == {request}
        await eventually(lambda: [r.node_id for r in log.of(NodeReady)][:1] == ["spot-1"])
        assert {r.request_id for r in log.of(NodeReady)} == {request}
        assert sorted(p.name for p in (state_dir / "pools" / "spot").glob("*.json")) == [
            "spot-1.json"
        ]
        assert len(list((state_dir / "requests").glob("*.json"))) == 1
        assert [n.node_id for n in await ledger.nodes() if n.node_id.startswith("spot-")] == [
            "spot-1"
        ]

        # The status is written at the end of the cycle that published NodeReady: it may lag
        # the event by that cycle.
        async def reported_ready() -> bool:
            status = await status_of(ledger)
            spot = pool_of(status, "spot") if status else None
            return spot is not None and spot.ready == 1 and not spot.incoming

        await eventually(reported_ready, timeout_s=10)
        status = await status_of(ledger)
        assert status is not None and status.leader == "b" and status.term >= 2
        holder, term = await AutoscalerState(ledger.redis, ledger.prefix, "test").leader()
        assert (holder, term) == ("b", status.term)
        assert "resuming" in (replicas.workdir / "autoscaler-b.log").read_text()


async def test_demand_that_capacity_would_not_serve_triggers_nothing(
    autoscaling: Start, ready: Ready
) -> None:
    """A request that waits on its queue's quota (a free device is there) gets no node, and the
    status says why it is not for more capacity."""
    queues = """
tenants: {team-q: capped}
queues:
  - {name: capped, limit: {units: 1}}
"""
    stack, replicas, _ = autoscaling([("spot", 4.0, 3)], 60.0, devices=2, queues=queues)
    ledger = await ready(stack, 2)
    log = ScaleLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        replicas.start("a")

        async def acting() -> bool:
            return await status_of(ledger) is not None

        await eventually(acting, timeout_s=30)
        first = await client.submit_and_wait(JobRequested(job_id="q-0", tenant="team-q"))
        assert isinstance(first, AllocationGranted), first
        await client.submit(JobRequested(job_id="q-1", tenant="team-q"))

        async def quota_blocked() -> ScaleStatus | None:
            status = await status_of(ledger)
            if status and status.pending.ignored.get(JobReason.QUOTA_EXHAUSTED.value):
                return status
            return None

        status = await eventually(quota_blocked, timeout_s=30)
        assert status is not None
        assert status.pending.actionable_jobs == 0
        record = await ledger.get_job("q-1")
        assert record is not None and record.reason == JobReason.QUOTA_EXHAUSTED.value
        await asyncio.sleep(3)  # six more cycles
        assert not log.decisions(ScaleAction.SCALE_UP), log.events
        assert not log.of(NodeProvisioning)
        shown = cli(stack, "scale", "status")
        assert "1 quota_exhausted" in shown.stdout, shown.stdout


async def test_the_leader_lease_fences_every_write(ledger: Ledger) -> None:
    """One replica leads at a time; a term moves on when the lease changes hands, and a
    replica that lost it can no longer write the autoscaler's state."""
    a = AutoscalerState(ledger.redis, ledger.prefix, "a")
    b = AutoscalerState(ledger.redis, ledger.prefix, "b")
    term_a = await a.hold(300)
    assert term_a == 1 and await b.hold(300) is None
    assert await a.hold(300) == term_a  # renewing keeps the term
    await a.write(term_a, [["SET", "status", "{}"]])
    await asyncio.sleep(0.4)  # a's lease lapses (a paused replica)
    term_b = await b.hold(300)
    assert term_b == 2
    with pytest.raises(LostLeadership):
        await a.write(term_a, [["SET", "status", "stale"]])
    assert await ledger.redis.get(ledger.key("autoscaler", "status")) == b"{}"
    await b.resign()
    assert await a.hold(300) == 3  # taken again: a new term, so a resumes its journal


@pytest.mark.parametrize("stack_security", ["plain", "secure"])
async def test_a_request_only_a_pool_can_hold_waits_for_it_instead_of_being_rejected(
    autoscaling: Start, ready: Ready
) -> None:
    """A gang of two on one node exceeds every registered node (one device each); the pools'
    2-device nodes could hold it, so the scheduler keeps it pending (reason
    ``insufficient_capacity``: the autoscaler's demand), the autoscaler adds a node and the
    gang is granted there. A request no pool could hold either is still rejected. On the secure
    stack too: the autoscaler with its own identity, its nodes' collectors with theirs."""
    stack, replicas, _ = autoscaling([("pairs", 4.0, 1)], 30.0)
    ledger = await ready(stack, 1)
    async with stack.client() as client:
        replicas.start("a")
        # The acting replica publishes the pools' shapes with its first status.
        assert await eventually(lambda: ledger.pool_shapes(), timeout_s=30)
        gang = JobRequested(
            job_id="pair", tenant="team-a", count=2, gang=GangSpec(same_node=True), lease_ttl_s=600
        )
        granted = await client.submit_and_wait(gang, timeout_s=60)
        assert isinstance(granted, AllocationGranted), (granted, replicas.logs(), stack.logs())
        assert {s.node_id for s in granted.slices} == {"pairs-1"}
        too_big = JobRequested(
            job_id="quad", tenant="team-a", count=4, gang=GangSpec(same_node=True)
        )
        refused = await client.submit_and_wait(too_big, timeout_s=30)
        assert isinstance(refused, JobRejected) and refused.reason.value == "exceeds_node_capacity"
