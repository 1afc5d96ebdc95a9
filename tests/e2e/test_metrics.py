"""Every service's Prometheus exposition on a running stack: promtool's lint, and a real
Prometheus scraping the stack that answers every query of the Grafana dashboards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import generate_latest

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.autoscaler.metrics import AutoscalerMetrics
from xpupool.autoscaler.status import PoolStatus, ScaleStatus
from xpupool.client import connected
from xpupool.contracts import AllocationGranted, DeviceDemand, JobReason, JobRejected, JobRequested
from xpupool.devstack.servers import free_port, free_ports
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.placement.inventory import DeviceState, NodeState, PoolSnapshot
from xpupool.scheduler.metrics import MIB, QueueRow, pool_rows, queue_rows

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DASHBOARDS = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards"
# Grafana's own range variables, as a dashboard over the last hour would expand them.
GRAFANA_VARIABLES = {"$__range": "1h", "$__rate_interval": "1m", "$__interval": "1s"}


def dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard file, expr) of every target of every panel."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "prometheus", (path.name, panel["title"])
            for target in panel["targets"]:
                queries.append((path.name, target["expr"]))
    return queries


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def promtool_check(text: str) -> tuple[int, str]:
    """promtool's exit status and everything it printed about an exposition."""
    done = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    return done.returncode, done.stdout + done.stderr


def start_stack(make_stack: Callable[..., Stack]) -> tuple[Stack, dict[str, int]]:
    ports = dict(zip(("collector", "scheduler", "lease-manager"), free_ports(3), strict=True))
    stack = make_stack(
        [NodeSpec("node-p", "2xA100-80GB")],
        extra_env={
            "XPUPOOL_SAMPLE_INTERVAL_S": "0.2",
            "XPUPOOL_METRICS_PORT": str(ports["collector"]),
            "XPUPOOL_SCHEDULER_METRICS_PORT": str(ports["scheduler"]),
            "XPUPOOL_SCHEDULER_METRICS_REFRESH_S": "0.3",
            "XPUPOOL_LEASE_MANAGER_METRICS_PORT": str(ports["lease-manager"]),
            "XPUPOOL_LEASE_MANAGER_METRICS_REFRESH_S": "0.3",
        },
    )
    return stack, ports


async def traffic(stack: Stack, job_id: str) -> None:
    """One whole-device lease and one share, held a moment, then released."""
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        granted = []
        for suffix, demand in (("whole", DeviceDemand()), ("share", DeviceDemand(memory_mib=8192))):
            outcome = await client.submit_and_wait(
                JobRequested(job_id=f"{job_id}-{suffix}", tenant="t", count=1, device=demand)
            )
            assert isinstance(outcome, AllocationGranted), outcome
            granted.append(outcome)
        await asyncio.sleep(1.5)  # the lease gauges see them live
        for g in granted:
            reply = await client.release(g.lease_id, g.fencing_token, secret=g.lease_secret)
            assert reply.ok, reply


async def test_every_service_exposition_passes_promtool(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """After real traffic, each service's /metrics passes `promtool check metrics` (exit 0,
    nothing printed: no lint warning either)."""
    stack, ports = start_stack(make_stack)
    await ready(stack, 2)
    await traffic(stack, "lint")

    def ended() -> bool:
        text = fetch(f"http://127.0.0.1:{ports['lease-manager']}/metrics")
        return 'xpupool_lease_ends_total{reason="released"} 2.0' in text

    await eventually(lambda: asyncio.to_thread(ended), timeout_s=15)
    # A refusal at admission (here: resubmitting an ended job) counts like one in a cycle.
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        # Another request under the ended job's id (the same request again is a retry, with
        # no second outcome).
        answer = client.expect("lint-whole")
        again_request = JobRequested(job_id="lint-whole", tenant="t", count=1, labels={"try": "2"})
        body = msgspec.json.encode(again_request)
        await client.submit_raw(body, msg_id="lint-whole-again", tenant="t")
        again = await asyncio.wait_for(answer, 30)
    assert isinstance(again, JobRejected) and again.reason == JobReason.DUPLICATE_JOB, again

    def refused_counted() -> bool:
        text = fetch(f"http://127.0.0.1:{ports['scheduler']}/metrics")
        return 'xpupool_scheduler_rejections_total{reason="duplicate_job"} 1.0' in text

    await eventually(lambda: asyncio.to_thread(refused_counted), timeout_s=10)
    for service, port in ports.items():
        text = await asyncio.to_thread(fetch, f"http://127.0.0.1:{port}/metrics")
        assert "# TYPE" in text, service
        if service != "collector":
            assert 'python_gc_collections_total{generation="2"}' in text, service
        checked = await asyncio.to_thread(promtool_check, text)
        assert checked == (0, ""), service


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[dict[str, int]], str]]:
    """``start(ports)``: a real Prometheus scraping those ports every second; its base URL."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(ports: dict[str, int]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        jobs = [
            f"  - job_name: {name}\n    static_configs:\n      - targets: ['127.0.0.1:{p}']\n"
            for name, p in ports.items()
        ]
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
            + "".join(jobs)
        )
        with (tmp_path / "prometheus.log").open("wb") as log:
            processes.append(
                subprocess.Popen(
                    [
                        "prometheus",
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        return f"http://127.0.0.1:{port}"

    yield start
    for process in processes:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(base: str, expr: str) -> list[Any]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr, "time": time.time()})
    body = json.loads(fetch(url))
    assert body["status"] == "success", (expr, body)
    result: list[Any] = body["data"]["result"]
    return result


async def test_prometheus_answers_every_dashboard_query(
    make_stack: Callable[..., Stack],
    ready: Ready,
    prometheus: Callable[[dict[str, int]], str],
) -> None:
    """Prometheus scraping a running stack returns data for every expr of every dashboard."""
    queries = dashboard_queries()
    assert len({name for name, _ in queries}) == 5
    stack, ports = start_stack(make_stack)
    await ready(stack, 2)
    base = prometheus(ports)

    def all_up() -> bool:
        try:
            up = query(base, "up == 1")
        except OSError:
            return False
        return len(up) == len(ports)

    await eventually(lambda: asyncio.to_thread(all_up), timeout_s=30)
    # Traffic after scraping started, so rates and quantiles see it change.
    await traffic(stack, "dash")
    missing: list[tuple[str, str]] = []
    for name, expr in queries:
        for key, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(key, value)

        def answered(e: str = expr) -> bool:
            return bool(query(base, e))

        try:
            await eventually(lambda: asyncio.to_thread(answered), timeout_s=15)
        except (AssertionError, TimeoutError):
            missing.append((name, expr))
    assert missing == []


def test_autoscaler_exposition_passes_promtool() -> None:
    """The autoscaler's registry after a cycle's status and a decision passes promtool too
    (its service needs a provider; the stack above runs none)."""
    metrics = AutoscalerMetrics()
    pool = PoolStatus(
        name="a100",
        provider="fake",
        model="A100-SXM4-80GB",
        devices_per_node=8,
        min_size=0,
        max_size=4,
        ready=1,
        provisioning=1,
        draining=0,
        node_cost_per_hour=30.0,
        cost_per_hour=60.0,
    )
    metrics.observe(ScaleStatus(leader="as-1", term=1, at=0.0, interval_s=1.0, pools=[pool]))
    metrics.decisions.labels("scale_up", "pending_demand").inc()
    metrics.cycle_seconds.observe(0.01)
    assert promtool_check(generate_latest(metrics.registry).decode()) == (0, "")


def test_pool_rows_sum_devices_memory_and_capacity_by_model() -> None:
    """A device counts as used when anything holds part of it; free capacity is the unheld
    fraction of its memory times its units; utilization averages the reporting devices."""

    def dev(
        i: int, free: int, *, exclusive: bool = False, util: float | None = None
    ) -> DeviceState:
        return DeviceState(
            device_id=f"n/d{i}",
            node_id="n",
            vendor="nvidia",
            model="A100",
            memory_total_mib=1000,
            memory_free_mib=free,
            exclusive=exclusive,
            capacity_units=2.0,
            util_pct=util,
        )

    snapshot = PoolSnapshot(
        nodes=(NodeState("n", (dev(0, 1000), dev(1, 250, util=50.0), dev(2, 0, exclusive=True))),)
    )
    (row,) = pool_rows(snapshot)
    assert (row.devices, row.devices_used) == (3, 2)
    assert (row.memory_bytes, row.memory_free_bytes) == (3000 * MIB, 1250 * MIB)
    assert (row.capacity_units, row.capacity_free_units) == (6.0, 2.5)
    assert (row.util_sum, row.util_reporting) == (0.5, 1)
    assert queue_rows([("q", 3.0), ("r", 1.0), ("q", 7.0)]) == [
        QueueRow("q", 2, 7.0),
        QueueRow("r", 1, 1.0),
    ]
