"""``xpupool replay --live``: the FGD protocol's arrival sequence through the running services.

For one (policy, seed), the in-process replay places the shuffled, inflated pod list on a
``ClusterState``; the live replay submits the same sequence as job requests to a real stack
(scheduler, lease-manager, Redis, NATS; embedded servers unless ``XPUPOOL_NATS_URL`` /
``XPUPOOL_REDIS_URL`` are set) whose nodes are the trace's nodes, simulated by one fleet collector
process (``xpupool.telemetry_collector.fleet``), and whose queue places with the scheduler's
name for the policy (:func:`scheduler_policy`): ``xpupool-online`` is the scheduler's own default
``xpupool`` (it learns the shapes from the requests it decides), every other policy its trace
policy ``<policy>-trace`` (``xpupool.placement.node_policies``). Pods go one at a time; each
waits for its outcome:

* granted: the slices say where it went;
* pending (it does not fit now; arrivals only, so it never will): the FGD protocol drops it, so
  the runner withdraws it from the pending queue (``drop_pending``, reason ``withdrawn``);
* rejected (no node could ever host it): dropped.

How a pod becomes a request: ``count = num_gpu``; a whole-GPU pod asks whole devices (several
on one node: ``gang.same_node``); a sharing pod asks ``compute_pct = gpu_milli / 10`` (memory in
proportion); ``cpu_milli``/``memory_mib`` are the host demand; ``gpu_spec`` models become
``selector.models`` under their catalog names; ``intent`` is ``any`` (the trace states no
preference between models beyond ``gpu_spec``). A CPU-only pod (``num_gpu == 0``) is a host-only
request (``count: 0``): its CPU and memory on one node, no device; the grant's ``host`` says which
node. The lease term is the longest the contract allows (7 days), so nothing expires during a
run. Catalog models without memory (the trace's anonymised G1-G3) get a placeholder
(:data:`PLACEHOLDER_MEMORY_GB`) through an operator catalog: a device without memory takes no
share at all.

Every pod of the sequence, CPU-only ones included, is submitted, and the live run is compared
with the standard in-process run of the same sequence (exactly equal, pod by pod).

The allocation ratio is computed by the replay's own code: the live placements are replayed
into a ``ClusterState`` (every one re-validated) with :func:`replay_arrivals`, so both numbers
come from the same arithmetic.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np
from nats.aio.msg import Msg
from redis.asyncio import Redis

from xpupool.bus import ensure_streams
from xpupool.client import connected
from xpupool.contracts import AllocationGranted, JobPending, JobRejected, JobRequested, decoder_for
from xpupool.contracts import subjects as s
from xpupool.devices import load_catalog
from xpupool.devstack.stack import ServiceProcess, Stack
from xpupool.ledger import Ledger
from xpupool.placement import PodDemand, PolicyContext, make_policy
from xpupool.placement.default import DEFAULT_POLICY_NAME as LEARNED_DEFAULT
from xpupool.placement.default import ONLINE_POLICY
from xpupool.placement.frag import ShapeDistribution
from xpupool.placement.node_policies import trace_policy_name
from xpupool.placement.state import MILLI, NodeSpec
from xpupool.replay.arrivals import (
    Outcome,
    RecordedPolicy,
    RecordingPolicy,
    RunResult,
    build_fgd_workload,
    fgd_cluster,
    replay_arrivals,
)
from xpupool.replay.requests import job_request as pod_request
from xpupool.replay.trace import TracePod, format_pods
from xpupool.telemetry_collector.fleet import FleetNode, format_fleet

#: The longest lease term the contract allows: nothing may expire during a replay.
LEASE_TTL_S = 7 * 24 * 3600.0
TENANT = "replay"
FLEET_MODULE = "xpupool.telemetry_collector.fleet"
_PENDING_DECODER = decoder_for((JobPending,))


@dataclass
class LiveResult:
    """One live run beside the in-process runs it must match."""

    policy: str
    seed: int
    live: RunResult
    inprocess: RunResult
    submitted: int
    cpu_only: int
    granted: int
    withdrawn: int
    rejected: int
    grant_ms: list[float]
    drop_ms: list[float]
    wall_s: float
    first_divergence: int | None
    workdir: Path
    notes: list[str] = field(default_factory=list)

    def percentiles(self, values: Sequence[float]) -> dict[str, float]:
        """p50/p90/p99/max of ``values`` (NaN when empty)."""
        if not values:
            return {k: math.nan for k in ("p50", "p90", "p99", "max")}
        arr = np.array(values, dtype=np.float64)
        out = {f"p{q}": float(np.percentile(arr, q)) for q in (50, 90, 99)}
        out["max"] = float(arr.max())
        return out

    def as_dict(self) -> dict[str, object]:
        """JSON-ready summary."""
        return {
            "policy": self.policy,
            "scheduler_policy": scheduler_policy(self.policy),
            "seed": self.seed,
            "alloc_at_100": {
                "live": self.live.alloc_at(100),
                "inprocess": self.inprocess.alloc_at(100),
            },
            "final_alloc_pct": {
                "live": self.live.final_alloc_pct,
                "inprocess": self.inprocess.final_alloc_pct,
            },
            "first_divergence": self.first_divergence,
            "submitted": self.submitted,
            "cpu_only": self.cpu_only,
            "granted": self.granted,
            "withdrawn": self.withdrawn,
            "rejected": self.rejected,
            "submit_to_grant_ms": self.percentiles(self.grant_ms),
            "submit_to_pending_ms": self.percentiles(self.drop_ms),
            "wall_s": self.wall_s,
            "notes": self.notes,
        }


#: Memory given to catalog models that have none (the trace's anonymised G1-G3): a device
#: without memory takes no share (a compute share holds at least 1 MiB), the trace's do.
PLACEHOLDER_MEMORY_GB = 16


def catalog_override(models: set[str]) -> str:
    """An operator catalog (``extends = "builtin"``) giving memoryless ``models`` a placeholder."""
    catalog = load_catalog(None)
    lines = ['[catalog]\nextends = "builtin"\n']
    for m in sorted(models):
        entry = catalog.lookup(m)
        if entry is not None and not (entry.memory_visible_mib or entry.memory_nominal_mib):
            lines.append(f'[[model]]\nname = "{entry.name}"\nmemory_gb = {PLACEHOLDER_MEMORY_GB}\n')
    return "\n".join(lines)


def catalog_names(models: set[str], catalog_path: Path | None = None) -> dict[str, str]:
    """Trace model name -> catalog (ledger) name, for the models the catalog knows."""
    catalog = load_catalog(catalog_path)
    out: dict[str, str] = {}
    for m in sorted(models):
        entry = catalog.lookup(m)
        if entry is not None:
            out[m] = entry.name
    back: dict[str, str] = {}
    for trace_name, ledger_name in out.items():
        if ledger_name in back:
            raise ValueError(
                f"trace models {back[ledger_name]!r} and {trace_name!r} are both catalog "
                f"model {ledger_name!r}; the live replay needs them distinct"
            )
        back[ledger_name] = trace_name
    return out


def simulated_trace(
    nodes: Sequence[NodeSpec], pods: Sequence[PodDemand], catalog_toml: Path
) -> tuple[list[FleetNode], dict[str, str]]:
    """The trace's ``nodes`` as a simulated fleet, and its model names as the catalog's (trace
    name -> catalog name) for ``pods``' requests; writes the operator catalog the fleet and the
    services need (``catalog_override``) to ``catalog_toml``."""
    models = {n.model for n in nodes if n.model} | {
        m for p in pods if p.allowed_models for m in p.allowed_models
    }
    catalog_toml.write_text(catalog_override(models), encoding="utf-8")
    names = catalog_names(models, catalog_toml)
    missing = sorted({n.model for n in nodes if n.num_gpu and n.model not in names})
    if missing:
        raise ValueError(f"the catalog has no model {', '.join(missing)} for the trace's nodes")
    if any(n.num_gpu == 0 for n in nodes):
        raise ValueError("nodes without GPUs cannot be simulated (a device profile needs one)")
    fleet = [
        FleetNode(n.name, f"{n.num_gpu}x{names[n.model]}", n.cpu_milli, n.memory_mib) for n in nodes
    ]
    return fleet, names


def job_request(
    job_id: str, pod: PodDemand, names: dict[str, str], queue: str = TENANT
) -> JobRequested:
    """The job request of a pod, leased for the whole run (see the module docstring)."""
    return pod_request(job_id, pod, names, tenant=TENANT, queue=queue, lease_ttl_s=LEASE_TTL_S)


def _spawn_fleet(stack: Stack, fleet_csv: Path, interval_s: float) -> ServiceProcess:
    env = stack.base_env()
    env.update(XPUPOOL_SIMULATED_NODES=str(fleet_csv), XPUPOOL_SAMPLE_INTERVAL_S=str(interval_s))
    log_path = stack.workdir / "telemetry-fleet.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", FLEET_MODULE],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    service = ServiceProcess("telemetry-collector", process, env, log_path)
    stack.services.append(service)
    return service


def scheduler_policy(policy: str) -> str:
    """The scheduler's name for replay policy ``policy``: ``xpupool-online`` is the scheduler's
    own default (``xpupool``, learning shapes from the requests); the others are trace policies
    (``fgd`` -> ``fgd-trace``)."""
    return LEARNED_DEFAULT if policy == ONLINE_POLICY else trace_policy_name(policy)


def _queue_config(policy: str) -> str:
    name = scheduler_policy(policy)
    return (
        "preemption: {enabled: false}\n"
        "starvation: {after_s: 1000000000, max_holds: 0}\n"
        f"queues:\n  - {{name: {TENANT}, placement: {name}}}\n"
    )


def _inprocess(
    nodes: Sequence[NodeSpec],
    workload: Sequence[PodDemand],
    original: Sequence[PodDemand],
    typical: ShapeDistribution,
    policy: str,
    seed: int,
) -> tuple[RunResult, RecordingPolicy]:
    # Built exactly as replay_cli builds a run's policy.
    ctx = PolicyContext(rng=np.random.default_rng(seed), workload=list(original), typical=typical)
    rec = RecordingPolicy(make_policy(policy, ctx))
    return replay_arrivals(nodes, workload, rec, typical, seed=seed), rec


async def replay_live(
    nodes: Sequence[NodeSpec],
    trace_pods: Sequence[TracePod],
    policy: str,
    seed: int,
    ratio: float = 1.3,
    *,
    nats_url: str | None = None,
    redis_url: str | None = None,
    workdir: Path | None = None,
    outcome_timeout_s: float = 120.0,
    heartbeat_s: float = 10.0,
    progress: TextIO | None = None,
) -> LiveResult:
    """Run one live replay (see the module docstring) and the in-process runs to compare."""
    nodes = fgd_cluster(nodes, seed)  # the protocol's renamed nodes, live and in process
    work = workdir or Path(tempfile.mkdtemp(prefix="xpupool-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    original = [p.demand for p in trace_pods]
    catalog_toml = work / "catalog.toml"
    fleet, names = simulated_trace(nodes, original, catalog_toml)
    fleet_csv = work / "fleet.csv"
    fleet_csv.write_text(format_fleet(fleet), encoding="utf-8")
    pods_csv = work / "pods.csv"
    pods_csv.write_text(format_pods(trace_pods), encoding="utf-8")
    queues = work / "queues.yaml"
    queues.write_text(_queue_config(policy), encoding="utf-8")
    aliases = ",".join(f"{ledger}={trace}" for trace, ledger in sorted(names.items()))

    capacity = sum(n.num_gpu for n in nodes) * MILLI
    workload = build_fgd_workload(original, seed, capacity, ratio)
    typical = ShapeDistribution.typical(original)
    run_id = secrets.token_hex(3)
    stack = Stack(
        nodes=[],
        nats_url=nats_url,
        redis_url=redis_url,
        namespace=f"replay-{run_id}" if redis_url else "xpupool",
        workdir=work / "stack",
        extra_env={
            "XPUPOOL_QUEUE_CONFIG": str(queues),
            "XPUPOOL_CATALOG": str(catalog_toml),
            "XPUPOOL_PLACEMENT_WORKLOAD": str(pods_csv),
            "XPUPOOL_PLACEMENT_MODEL_ALIASES": aliases,
            "XPUPOOL_PLACEMENT_SEED": str(seed),
            # The fleet heartbeats every heartbeat_s; a slow sweep must never look like a loss.
            "XPUPOOL_NODE_GRACE_S": str(max(600.0, 20 * heartbeat_s)),
            "XPUPOOL_LOG_LEVEL": os.environ.get("XPUPOOL_LOG_LEVEL", "warning"),
        },
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    outcomes: list[Outcome] = []
    grant_ms: list[float] = []
    drop_ms: list[float] = []
    counts = {"granted": 0, "withdrawn": 0, "rejected": 0}
    index = {n.name: i for i, n in enumerate(nodes)}
    started = time.monotonic()
    try:
        stack.start()
        _spawn_fleet(stack, fleet_csv, heartbeat_s)
        assert stack.nats_url and stack.redis_url
        redis = Redis.from_url(stack.redis_url)
        try:
            ledger = Ledger(redis, stack.namespace)
            await _wait_registered(stack, redis, ledger, len(nodes))
            async with connected(stack.nats_url) as client:
                await ensure_streams(client.js, s.STREAMS)
                pending: dict[str, asyncio.Future[JobPending]] = {}

                async def on_pending(msg: Msg) -> None:
                    event = _PENDING_DECODER.decode(msg.data)
                    waiter = pending.get(event.job_id)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(event)

                sub = await client.nc.subscribe(s.JOB_PENDING.address, cb=on_pending)
                for i, pod in enumerate(workload):
                    job_id = f"replay-{run_id}-{i:06d}"
                    done = client.expect(job_id)
                    waits = pending[job_id] = asyncio.get_running_loop().create_future()
                    t0 = time.perf_counter()
                    await client.submit(job_request(job_id, pod, names))
                    finished, _ = await asyncio.wait(
                        {done, waits},
                        timeout=outcome_timeout_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    elapsed = (time.perf_counter() - t0) * 1000
                    if not finished:
                        raise TimeoutError(
                            f"no outcome for pod {i} ({pod}) in {outcome_timeout_s}s"
                        )
                    if done not in finished:
                        withdrawn = await ledger.drop_pending(
                            job_id, "withdrawn", None, "replay: did not fit on arrival"
                        )
                        if withdrawn.ok:
                            drop_ms.append(elapsed)
                            counts["withdrawn"] += 1
                            outcomes.append(None)
                            pending.pop(job_id, None)
                            continue
                        # Decided between the pending event and the withdrawal: take its outcome.
                        await asyncio.wait_for(done, outcome_timeout_s)
                        elapsed = (time.perf_counter() - t0) * 1000
                    pending.pop(job_id, None)
                    result = done.result()
                    if isinstance(result, AllocationGranted):
                        # A host-only grant (a CPU-only pod) has no slices; its host says where.
                        where = (
                            result.slices[0].node_id if result.slices else result.host[0].node_id
                        )
                        node = index[where]
                        gpus = tuple(sorted(sl.index for sl in result.slices))
                        outcomes.append((node, gpus))
                        grant_ms.append(elapsed)
                        counts["granted"] += 1
                    else:
                        outcomes.append(None)
                        counts["rejected"] += 1
                        if not isinstance(result, JobRejected):
                            raise RuntimeError(f"pod {i}: unexpected outcome {result!r}")
                    if progress is not None and (i + 1) % 100 == 0:
                        progress.write(f"\r  {i + 1}/{len(workload)} pods live")
                        progress.flush()
                await sub.unsubscribe()
        finally:
            await redis.aclose()
    except BaseException:
        sys.stderr.write(stack.logs()[-6000:] + "\n")
        raise
    finally:
        stack.stop()
    if progress is not None:
        progress.write("\n")
    wall = time.monotonic() - started

    live = replay_arrivals(nodes, workload, RecordedPolicy(policy, outcomes), typical, seed=seed)
    inprocess, rec = _inprocess(nodes, workload, original, typical, policy, seed)
    diverge = next(
        (i for i, (a, b) in enumerate(zip(outcomes, rec.outcomes, strict=True)) if a != b), None
    )
    notes: list[str] = []
    if policy == "random":
        notes.append("random: equal only while the scheduler draws once per pod (no retries)")
    return LiveResult(
        policy=policy,
        seed=seed,
        live=live,
        inprocess=inprocess,
        submitted=len(workload),
        cpu_only=sum(1 for p in workload if p.is_cpu_only),
        granted=counts["granted"],
        withdrawn=counts["withdrawn"],
        rejected=counts["rejected"],
        grant_ms=grant_ms,
        drop_ms=drop_ms,
        wall_s=wall,
        first_divergence=diverge,
        workdir=work,
        notes=notes,
    )


async def _wait_registered(stack: Stack, redis: Redis, ledger: Ledger, nodes: int) -> None:
    """Until every fleet node is in the ledger (a dead service fails fast)."""
    deadline = time.monotonic() + max(60.0, nodes * 0.1)
    while True:
        if int(await redis.scard(ledger.key("nodes"))) >= nodes:
            return
        dead = [svc.name for svc in stack.services if not svc.alive()]
        if dead:
            raise RuntimeError(f"service(s) exited during start-up: {', '.join(dead)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {nodes} nodes registered in time")
        await asyncio.sleep(0.2)


def format_result(r: LiveResult) -> str:
    """Human-readable report of one live run."""
    g = r.percentiles(r.grant_ms)
    d = r.percentiles(r.drop_ms)
    same = "equal" if r.first_divergence is None else f"DIFFER from pod {r.first_divergence}"
    return "\n".join(
        [
            f"policy {r.policy} (scheduler: {scheduler_policy(r.policy)}), seed {r.seed}: "
            f"{r.submitted} pods submitted ({r.cpu_only} CPU-only)",
            f"  alloc@100 live {r.live.alloc_at(100):.2f}%  in-process "
            f"{r.inprocess.alloc_at(100):.2f}%  ({same})",
            f"  final alloc live {r.live.final_alloc_pct:.2f}%  in-process "
            f"{r.inprocess.final_alloc_pct:.2f}%",
            f"  granted {r.granted}, withdrawn (did not fit) {r.withdrawn}, rejected {r.rejected}",
            f"  submit->grant ms p50 {g['p50']:.1f} p90 {g['p90']:.1f} p99 {g['p99']:.1f} "
            f"max {g['max']:.1f}; submit->pending ms p50 {d['p50']:.1f} p99 {d['p99']:.1f}",
            f"  wall {r.wall_s:.0f} s",
            *(f"  note: {n}" for n in r.notes),
        ]
    )


def main_live(
    nodes: Sequence[NodeSpec],
    trace_pods: Sequence[TracePod],
    policies: Sequence[str],
    seeds: Sequence[int],
    ratio: float,
    as_json: bool,
) -> int:
    """``xpupool replay --live``: one live run per (policy, seed); exit 1 if any differs."""
    results: list[LiveResult] = []
    progress = sys.stderr if sys.stderr.isatty() else None
    for policy in policies:
        for seed in seeds:
            results.append(
                asyncio.run(
                    replay_live(
                        nodes,
                        trace_pods,
                        policy,
                        seed,
                        ratio,
                        nats_url=os.environ.get("XPUPOOL_NATS_URL"),
                        redis_url=os.environ.get("XPUPOOL_REDIS_URL"),
                        progress=progress,
                    )
                )
            )
            if not as_json:
                print(format_result(results[-1]), flush=True)
    if as_json:
        print(json.dumps([r.as_dict() for r in results], indent=2, allow_nan=True))
    return 0 if all(r.first_divergence is None for r in results) else 1
