"""``just bench-autoscale``: autoscaled node pools against fixed ones on the trace's own arrivals.

The dynamic replay of the Alibaba GPU trace (each pod arrives at its creation time and runs for
``deletion - creation`` seconds from the moment it is placed; pods that do not fit wait in a
FIFO queue, retried whenever capacity frees or arrives) is run four times on the same arrivals,
with the same placement policy (the scheduler default's placement, ``xpupool-online``):

* **peak-sized**: a fixed pool with, per node shape, as many nodes as were ever busy at once
  when the trace ran on its whole cluster (the smallest fixed fleet that held the peak);
* **mean-sized**: a fixed pool with, per node shape, the time-weighted mean of busy nodes;
* **reactive** and **predictive** autoscaling from zero nodes (``min_size: 0``), up to the trace
  cluster's count per shape, with the autoscaler's own code: the scale-up solver
  (``xpupool.autoscaler.solver.PlacementSolver``, the placement engine on hypothetical nodes)
  over the queued pods every tick, provisioning that takes ``--delay`` seconds, scale-down by
  ``plan_scale_down`` (idle past the cool-down, low-watermark hysteresis, drained nodes removed
  once empty); predictive mode adds the nodes the forecast
  (``xpupool.autoscaler.forecast``: damped trend plus time-of-day profile) says the pool will
  need one provisioning delay ahead, and its scale-down keeps them while the forecast does.

Pools are the trace's node shapes (model, GPUs, CPU, memory), priced at the device catalog's
cost per device-hour times the GPUs (``xpupool.devices`` catalog; G1-G3 are the trace's
anonymised models). Cost is node-hours times price over the replay's span; waits are from a
pod's creation to its placement. The JSON report gives the ratios the issue asks for: p95 wait
against the peak-sized pool's, cost against the peak-sized pool's.

``--sample K`` keeps every K-th node and pod (a quick look); the default is the whole trace.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xpupool.autoscaler.decisions import forecast_nodes
from xpupool.autoscaler.forecast import forecast
from xpupool.autoscaler.pools import PoolConfig, parse_pools
from xpupool.autoscaler.scale_down import NodeStatus, PoolLoad, peak_busy, plan_scale_down
from xpupool.autoscaler.solver import (
    NodeState,
    PendingJob,
    PlacementSolver,
    PoolNode,
    ScaleUpProblem,
)
from xpupool.contracts import JobReason, JobRequested, ScaleAction
from xpupool.devices.catalog import Catalog, load_catalog
from xpupool.placement import ClusterState, NodeSpec, make_policy
from xpupool.placement.state import NodeChoice
from xpupool.replay.arrivals import fgd_cluster
from xpupool.replay.requests import job_request
from xpupool.replay.trace import TracePod, find_trace_dir, load_nodes, load_pods

LOOKBACK_S = 2 * 24 * 3600.0
"""How much demand history the predictive mode's forecast reads (two days: two daily cycles)."""

UNSCHEDULABLE = 1 << 40
"""Taken off an absent or draining node's free CPU, so no policy can choose it (``feasible``
compares free CPU with the request) while releases still count back exactly."""


@dataclass
class Run:
    """What one replay measured."""

    name: str
    waits: list[float] = field(default_factory=list)
    never_placed: int = 0
    node_seconds: dict[str, float] = field(default_factory=dict)
    cost: float = 0.0
    busy_peak: dict[str, int] = field(default_factory=dict)
    busy_mean: dict[str, float] = field(default_factory=dict)
    scale_ups: int = 0
    removals: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        w = np.array(self.waits) if self.waits else np.zeros(1)
        return {
            "policy_run": self.name,
            "pods_placed": len(self.waits),
            "pods_waited": int((w > 0).sum()) if self.waits else 0,
            "wait_s_mean": float(w.mean()),
            "never_placed": self.never_placed,
            "wait_s": {f"p{q}": float(np.percentile(w, q)) for q in (50, 90, 95, 99)},
            "node_hours": round(float(sum(self.node_seconds.values())) / 3600, 1),
            "cost": round(float(self.cost), 2),
            "scale_ups": self.scale_ups,
            "nodes_removed": self.removals,
            "wall_s": round(self.seconds, 1),
        }


class Fleet:
    """The trace cluster's rows, each present or not, schedulable or not, for one replay."""

    def __init__(self, nodes: Sequence[NodeSpec], pool_of: Sequence[str]) -> None:
        self.state = ClusterState.from_nodes(nodes)
        self.pool_of = list(pool_of)
        self.present = np.zeros(len(nodes), dtype=np.bool_)
        self.schedulable = np.ones(len(nodes), dtype=np.bool_)
        self.up_since = np.full(len(nodes), math.nan)
        self.idle_since = np.full(len(nodes), math.nan)
        self.draining_since = np.full(len(nodes), math.nan)
        for row in range(len(nodes)):
            self._block(row)

    def _block(self, row: int) -> None:
        if self.schedulable[row]:
            self.state.cpu_free[row] -= UNSCHEDULABLE
            self.schedulable[row] = False
            self.state.node_version[row] += 1

    def _unblock(self, row: int) -> None:
        if not self.schedulable[row]:
            self.state.cpu_free[row] += UNSCHEDULABLE
            self.schedulable[row] = True
            self.state.node_version[row] += 1

    def bring_up(self, row: int, now: float) -> None:
        self.present[row] = True
        self.up_since[row] = now
        self.idle_since[row] = now
        self.draining_since[row] = math.nan
        self._unblock(row)

    def drain(self, row: int, now: float) -> None:
        self.draining_since[row] = now
        self._block(row)

    def undrain(self, row: int) -> None:
        self.draining_since[row] = math.nan
        self._unblock(row)

    def take_down(self, row: int, now: float, run: Run) -> None:
        pool = self.pool_of[row]
        run.node_seconds[pool] = run.node_seconds.get(pool, 0.0) + now - self.up_since[row]
        self.present[row] = False
        self.up_since[row] = math.nan
        self.draining_since[row] = math.nan
        self._block(row)

    def busy(self, row: int) -> bool:
        return bool(self.state.pod_count[row] > 0)


def pool_name(node: NodeSpec, model: str) -> str:
    return f"{model}-{node.num_gpu}x-{node.cpu_milli // 1000}c-{node.memory_mib // 1024}g".replace(
        ".", "_"
    )


def build_pools(
    nodes: Sequence[NodeSpec], catalog: Catalog, *, delay_s: float, predictive: bool
) -> tuple[list[str], dict[str, PoolConfig], dict[str, str]]:
    """Row -> pool name, the pools (one per node shape), trace model -> catalog model."""
    names: dict[str, str] = {}
    for n in nodes:
        if n.model and n.model not in names:
            entry = catalog.lookup(n.model)
            if entry is None:
                raise SystemExit(f"bench-autoscale: model {n.model!r} is not in the catalog")
            names[n.model] = entry.name
    pool_of = [pool_name(n, names.get(n.model, "cpu")) for n in nodes]
    entries: dict[str, dict[str, Any]] = {}
    for n, name in zip(nodes, pool_of, strict=True):
        if name in entries:
            entries[name]["max_size"] += 1
            continue
        entries[name] = {
            "name": name,
            "node": {
                "model": names[n.model],
                "count": n.num_gpu,
                "cpu_milli": n.cpu_milli,
                "memory_mib": n.memory_mib,
            },
            "min_size": 0,
            "max_size": 1,
            "provisioning_delay_s": delay_s,
            "scale_down": {"cooldown_s": 900.0, "low_watermark": 0.8},
            "predictive": predictive,
            "provider": {"type": "simulated"},
        }
    config = parse_pools({"pools": list(entries.values())}, catalog=catalog)
    return pool_of, {p.name: p for p in config.pools}, names


def replay(
    name: str,
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    pool_of: Sequence[str],
    pools: dict[str, PoolConfig],
    model_names: dict[str, str],
    *,
    fixed: Sequence[int] | None,
    predictive: bool = False,
    tick_s: float = 60.0,
    scale_down_every_s: float = 600.0,
) -> Run:
    """One dynamic replay; ``fixed`` rows are up from the start and nothing scales, else the
    autoscaler runs (see the module docstring)."""
    started = time.perf_counter()
    run = Run(name)
    fleet = Fleet(nodes, pool_of)
    policy = make_policy("xpupool-online")
    solver = PlacementSolver()
    rows_of: dict[str, list[int]] = {}
    for row, p in enumerate(pool_of):
        rows_of.setdefault(p, []).append(row)
    order = sorted(range(len(pods)), key=lambda i: (pods[i].creation_time, i))
    t0 = float(pods[order[0]].creation_time) if order else 0.0
    for row in fixed or ():
        fleet.bring_up(row, t0)
    departures: list[tuple[float, int, int]] = []
    ready: list[tuple[float, int]] = []  # (ready at, row)
    provisioning: dict[int, float] = {}
    running: dict[int, NodeChoice] = {}
    queue: deque[int] = deque()
    requests: dict[int, JobRequested] = {}
    busy = dict.fromkeys(pools, 0)
    busy_area = dict.fromkeys(pools, 0.0)
    busy_history: dict[str, list[tuple[float, int]]] = {p: [] for p in pools}
    demand_history: dict[str, list[tuple[float, float]]] = {p: [] for p in pools}
    # Per pool, the nodes the last forecast wanted: the scale-down keeps them (keep_nodes).
    forecast_keep: dict[str, int] = {p: 0 for p in pools}
    last_change = t0
    wanted: dict[str, set[str]] = {p: set() for p in pools}
    seq = 0
    # The scheduler rejects a request no node of the whole cluster could ever hold
    # (``never_fits``); it never waits, so it never asks the autoscaler either.
    empty = ClusterState.from_nodes(nodes)
    never = {i for i in range(len(pods)) if not empty.feasible(pods[i].demand).any()}
    run.never_placed = len(never)
    changed = True
    """Whether the queue or the capacity changed since the last scale-up question."""

    def account_busy(now: float) -> None:
        nonlocal last_change
        for p, b in busy.items():
            busy_area[p] += b * (now - last_change)
        last_change = now

    def set_busy(row: int, delta: int, now: float) -> None:
        account_busy(now)
        p = pool_of[row]
        busy[p] += delta
        run.busy_peak[p] = max(run.busy_peak.get(p, 0), busy[p])
        busy_history[p].append((now, busy[p]))
        fleet.idle_since[row] = math.nan if delta > 0 else now

    def try_place(i: int, now: float) -> bool:
        nonlocal seq
        # The policies' own filter, vectorised: a pod no node can hold costs no scoring.
        if not fleet.state.feasible(pods[i].demand).any():
            return False
        choice = policy.choose(fleet.state, pods[i].demand)
        if choice is None:
            return False
        was_busy = fleet.busy(choice.node)
        fleet.state.allocate(choice)
        if not was_busy:
            set_busy(choice.node, +1, now)
        running[i] = choice
        duration = max(0, pods[i].deletion_time - pods[i].creation_time)
        heapq.heappush(departures, (now + duration, seq, i))
        seq += 1
        run.waits.append(now - pods[i].creation_time)
        return True

    def drain_queue(now: float) -> None:
        # A shape that did not fit in this pass will not fit later in it either: the queue is
        # retried once per shape, not once per pod (the trace repeats shapes a lot).
        refused: set[tuple[object, ...]] = set()
        for _ in range(len(queue)):
            i = queue.popleft()
            d = pods[i].demand
            shape = (d.cpu_milli, d.memory_mib, d.num_gpu, d.gpu_milli, d.allowed_models)
            if shape in refused or not try_place(i, now):
                refused.add(shape)
                queue.append(i)

    def scale_up(now: float) -> None:
        nonlocal changed
        if not queue or not changed:
            return
        changed = False
        pending = []
        for i in queue:
            req = requests.get(i)
            if req is None:
                req = requests[i] = job_request(
                    pods[i].demand.name or f"pod-{i}", pods[i].demand, model_names
                )
            pending.append(
                PendingJob(req, "t", JobReason.INSUFFICIENT_CAPACITY, float(pods[i].creation_time))
            )
        present = {p: 0 for p in pools}
        for row in np.flatnonzero(fleet.present).tolist():
            present[pool_of[row]] += 1
        incoming = [PoolNode(pool_of[r], NodeState.PROVISIONING) for r in provisioning]
        room = {
            p: cfg.max_size - present[p] - sum(1 for r in provisioning if pool_of[r] == p)
            for p, cfg in pools.items()
        }
        answer = solver.solve(
            ScaleUpProblem(pending=pending, pools=list(pools.values()), room=room, nodes=incoming)
        )
        for p in pools:
            wanted[p] = {j for j, q in answer.served_by_incoming.items() if q == p}
        for addition in answer.additions:
            wanted[addition.pool] |= set(addition.job_ids)
            add(addition.pool, addition.count, now)

    def add(pool: str, count: int, now: float) -> None:
        free = [r for r in rows_of[pool] if not fleet.present[r] and r not in provisioning]
        for row in free[:count]:
            provisioning[row] = now
            heapq.heappush(ready, (now + pools[pool].provisioning_delay_s, row))
            run.scale_ups += 1

    def predict(now: float) -> None:
        for p, cfg in pools.items():
            coming = sum(1 for r in provisioning if pool_of[r] == p)
            # The pool's demand in nodes: those busy now and those already asked for.
            history = demand_history[p]
            history.append((now, float(busy[p] + coming)))
            if history[0][0] < now - 1.2 * LOOKBACK_S:  # what the forecast reads, and no more
                demand_history[p] = history = [x for x in history if x[0] >= now - LOOKBACK_S]
            if len(history) < 2:
                continue
            f = forecast(
                demand_history[p],
                now,
                cfg.provisioning_delay_s,
                bucket_s=900.0,
                lookback_s=LOOKBACK_S,
            )
            up = sum(
                1 for r in rows_of[p] if fleet.present[r] and math.isnan(fleet.draining_since[r])
            )
            # The history is in nodes; the service's rule takes devices.
            forecast_keep[p] = forecast_nodes(cfg, f.peak * cfg.node.count)
            need = forecast_keep[p] - up - coming
            if need > 0:
                add(p, need, now)

    def scale_down(now: float) -> None:
        for p, cfg in pools.items():
            statuses = []
            for r in rows_of[p]:
                if not fleet.present[r]:
                    continue
                idle = None if fleet.busy(r) else float(fleet.idle_since[r])
                statuses.append(
                    NodeStatus(
                        node_id=str(r),
                        idle_since=idle,
                        lease_ids=("busy",) if fleet.busy(r) else (),
                        draining_since=None
                        if math.isnan(fleet.draining_since[r])
                        else float(fleet.draining_since[r]),
                    )
                )
            if not statuses:
                continue
            coming = sum(1 for r in provisioning if pool_of[r] == p)
            load = PoolLoad(
                recent_peak_busy=peak_busy(busy_history[p], now, cfg.scale_down.cooldown_s)
                if busy_history[p]
                else 0,
                pending_jobs=tuple(sorted(wanted[p])),
            )
            steps = plan_scale_down(
                cfg, statuses, load, now, provisioning=coming, keep_nodes=forecast_keep[p]
            )
            for step in steps:
                for node_id in step.node_ids:
                    r = int(node_id)
                    if step.action is ScaleAction.DRAIN:
                        fleet.drain(r, now)
                    elif step.action is ScaleAction.UNDRAIN:
                        fleet.undrain(r)
                    elif step.action is ScaleAction.REMOVE and not fleet.busy(r):
                        account_busy(now)
                        fleet.take_down(r, now, run)
                        run.removals += 1
            # Old samples are no longer read: keep the history short.
            cut = now - 2 * cfg.scale_down.cooldown_s
            if len(busy_history[p]) > 256:
                busy_history[p] = [s for s in busy_history[p] if s[0] >= cut] or busy_history[p][
                    -1:
                ]

    autoscale = fixed is None
    next_tick = t0
    next_down = t0 + scale_down_every_s
    k = 0
    now = t0
    while k < len(order) or departures or (queue and (ready or autoscale)):
        next_arrival = float(pods[order[k]].creation_time) if k < len(order) else math.inf
        next_departure = departures[0][0] if departures else math.inf
        next_ready = ready[0][0] if ready else math.inf
        tick = next_tick if autoscale else math.inf
        now = min(next_arrival, next_departure, next_ready, tick)
        if now == math.inf:
            break
        if now == next_departure:
            while departures and departures[0][0] == now:
                _, _, i = heapq.heappop(departures)
                choice = running.pop(i)
                fleet.state.release(choice)
                if not fleet.busy(choice.node):
                    set_busy(choice.node, -1, now)
            drain_queue(now)
            changed = True
        elif now == next_ready:
            while ready and ready[0][0] == now:
                _, row = heapq.heappop(ready)
                provisioning.pop(row, None)
                fleet.bring_up(row, now)
            drain_queue(now)
            changed = True
        elif now == next_arrival:
            i = order[k]
            k += 1
            if i not in never and not try_place(i, now):
                queue.append(i)
                changed = True
        else:
            next_tick = now + tick_s
            scale_up(now)
            if predictive and now >= next_down - tick_s:
                predict(now)
            if now >= next_down:
                next_down = now + scale_down_every_s
                scale_down(now)
            if k >= len(order) and not departures and not ready and queue:
                break  # what is left never fits any pool
    end = now
    account_busy(end)
    for up_row in np.flatnonzero(fleet.present).tolist():
        fleet.take_down(up_row, end, run)
    span = max(end - t0, 1.0)
    run.busy_mean = {p: busy_area[p] / span for p in pools}
    run.never_placed += len(queue)
    run.cost = sum(
        run.node_seconds.get(p, 0.0) / 3600 * cfg.cost_per_hour for p, cfg in pools.items()
    )
    run.seconds = time.perf_counter() - started
    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-autoscale", description=__doc__)
    parser.add_argument("--sample", type=int, default=1, help="keep every K-th node and pod")
    parser.add_argument("--delay", type=float, default=300.0, help="provisioning delay, s")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        print("bench-autoscale: the Alibaba trace is not beside the repository", file=sys.stderr)
        return 2
    nodes = fgd_cluster(
        load_nodes(trace / "openb_node_list_gpu_node.csv")[:: args.sample], args.seed
    )
    pods = load_pods(trace / "openb_pod_list_default.csv")[:: args.sample]
    catalog = load_catalog()
    runs: dict[str, Run] = {}
    pool_of, pools, names = build_pools(nodes, catalog, delay_s=args.delay, predictive=False)
    every = list(range(len(nodes)))
    whole = replay("whole-cluster", nodes, pods, pool_of, pools, names, fixed=every)
    print(f"whole cluster: {whole.summary()}", file=sys.stderr)

    def sized(counts: dict[str, int]) -> list[int]:
        out: list[int] = []
        for p in pools:
            rows = [r for r, q in enumerate(pool_of) if q == p]
            out.extend(rows[: counts.get(p, 0)])
        return out

    peak = {p: whole.busy_peak.get(p, 0) for p in pools}
    mean = {p: math.ceil(whole.busy_mean.get(p, 0.0)) for p in pools}
    runs["peak-sized"] = replay("peak-sized", nodes, pods, pool_of, pools, names, fixed=sized(peak))
    runs["mean-sized"] = replay("mean-sized", nodes, pods, pool_of, pools, names, fixed=sized(mean))
    runs["reactive"] = replay("reactive", nodes, pods, pool_of, pools, names, fixed=None)
    _, predictive_pools, _ = build_pools(nodes, catalog, delay_s=args.delay, predictive=True)
    runs["predictive"] = replay(
        "predictive", nodes, pods, pool_of, predictive_pools, names, fixed=None, predictive=True
    )
    ref = runs["peak-sized"].summary()
    report: dict[str, Any] = {
        "trace_nodes": len(nodes),
        "pods": len(pods),
        "provisioning_delay_s": args.delay,
        "pools": len(pools),
        "peak_sized_nodes": sum(peak.values()),
        "mean_sized_nodes": sum(mean.values()),
        "whole_cluster": whole.summary(),
        "runs": {},
    }
    for name, r in runs.items():
        s = r.summary()
        print(f"{name}: {s}", file=sys.stderr)
        p95, ref95 = s["wait_s"]["p95"], ref["wait_s"]["p95"]
        # A ratio to a zero wait is infinite unless the wait is zero too.
        s["p95_wait_vs_peak"] = p95 / ref95 if ref95 > 0 else (1.0 if p95 == 0 else math.inf)
        s["cost_vs_peak"] = s["cost"] / ref["cost"] if ref["cost"] else math.nan
        report["runs"][name] = s
    for name in ("reactive", "predictive"):
        s = report["runs"][name]
        s["goal_met"] = bool(s["p95_wait_vs_peak"] <= 1.10 and s["cost_vs_peak"] < 0.60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    print(
        "\nrun          p50 s    p95 s    p99 s   never  node-h      cost  p95/peak  cost/peak",
        file=sys.stderr,
    )
    for name, s in report["runs"].items():
        w = s["wait_s"]
        print(
            f"{name:<11} {w['p50']:7.0f} {w['p95']:8.0f} {w['p99']:8.0f} {s['never_placed']:7d} "
            f"{s['node_hours']:7.0f} {s['cost']:9.0f} {s['p95_wait_vs_peak']:9.2f} "
            f"{s['cost_vs_peak']:10.2f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
