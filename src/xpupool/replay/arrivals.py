"""Trace replay: the FGD paper's arrival-only protocol and a dynamic (arrivals + departures) mode.

Pure computation: callers load the trace and print the results (see ``replay_cli``).
"""

from __future__ import annotations

import heapq
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from xpupool.placement.frag import FragEvaluator, ShapeDistribution
from xpupool.placement.policies import Policy
from xpupool.placement.state import (
    ClusterState,
    FloatArray,
    IntArray,
    NodeChoice,
    NodeSpec,
    PodDemand,
)
from xpupool.replay.trace import TracePod

#: Arrival points (% of cluster GPU capacity) reported for allocation.
ALLOC_POINTS = (90, 95, 100, 110, 130)
#: Arrival points reported for fragmentation amount.
FRAG_POINTS = (50, 80, 100)
#: Bins 0..MAX_BIN % arrival are kept per run.
MAX_BIN = 135
POD_KINDS = ("cpu", "share", "one", "multi")


#: The stream of the run's seed the node renaming draws from (the arrival order uses its own).
_RENAME_STREAM = 0x5EED


def fgd_cluster(nodes: Sequence[NodeSpec], seed: int) -> list[NodeSpec]:
    """The FGD protocol's cluster for one seed: every node renamed with a random prefix.

    Before any pod arrives, the published simulator sorts the nodes by name and renames node
    ``i`` to ``"%04d-" % perm[i] + name`` with ``perm = rand.Perm(n)`` from the run's seeded
    ``math/rand`` (hkust-adsl/kubernetes-scheduler-simulator ``pkg/simulator/simulator.go``,
    ``syncClusterResourceList``); its ``selectHost`` then gives equal scores to the smallest
    name (``generic_scheduler.go``: "for reproducibility, choose the smallest lexicographical
    order"). So every policy's ties go to a random node order drawn once per run, not to the
    plain names. This matters wherever scores tie: GPU packing and clustering score CPU-only
    pods 0 on every node, and in plain name order they land on the first nodes (0.7-0.8 points
    below the published numbers; within 0.2 of them renamed). Rows keep their order.
    """
    rng = np.random.default_rng([seed, _RENAME_STREAM])
    by_name = sorted(nodes, key=lambda n: n.name)
    perm = rng.permutation(len(by_name))
    width = max(4, len(str(max(len(by_name) - 1, 0))))
    renamed = {n.name: f"{int(p):0{width}d}-{n.name}" for n, p in zip(by_name, perm, strict=True)}
    return [replace(n, name=renamed[n.name]) for n in nodes]


def trace_name(name: str) -> str:
    """A node's name in the trace, from its name in an ``fgd_cluster`` (prefix removed)."""
    prefix, sep, rest = name.partition("-")
    return rest if sep and prefix.isdigit() else name


def build_fgd_workload(
    pods: Sequence[PodDemand], seed: int, capacity_milli: int, ratio: float = 1.3
) -> list[PodDemand]:
    """The FGD protocol's arrival sequence for one seed.

    Sort by name, shuffle with ``seed``, then append pods drawn uniformly with replacement from
    the original list until the cumulative GPU request would exceed ``ratio`` x capacity. If the
    list alone already exceeds it, random pods are removed instead (as the simulator does).
    """
    rng = np.random.default_rng(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    perm = rng.permutation(len(ordered))
    out = [ordered[int(i)] for i in perm]
    target = ratio * capacity_milli
    total = sum(p.gpu_request_milli for p in out)
    if total > target:
        while total > target and out:
            victim = out.pop(int(rng.integers(len(out))))
            total -= victim.gpu_request_milli
        return out
    if not any(p.gpu_request_milli for p in ordered):
        return out
    while True:
        extra = ordered[int(rng.integers(len(ordered)))]
        if total + extra.gpu_request_milli > target:
            break
        out.append(extra)
        total += extra.gpu_request_milli
    return out


@dataclass
class PlacementRecord:
    """One placed pod, for the ``--placements`` CSV."""

    pod: str
    node: str
    gpus: tuple[int, ...]
    gpu_milli: int


@dataclass
class RunResult:
    """Per-(policy, seed) outcome of the arrival-only replay."""

    policy: str
    seed: int
    pods: int
    alloc_by_arrival: FloatArray
    frag_by_arrival: FloatArray
    cpu_by_arrival: FloatArray
    rejected: dict[str, int]
    decision_ns: IntArray
    final_alloc_pct: float
    placements: list[PlacementRecord] = field(default_factory=list)

    def alloc_at(self, pct: int) -> float:
        """GPU allocation % at arrival ``pct`` %."""
        return float(self.alloc_by_arrival[pct])

    def frag_at(self, pct: int) -> float:
        """Fragmentation amount (% of cluster GPU) at arrival ``pct`` %."""
        return float(self.frag_by_arrival[pct])


def _binned(arr_pct: IntArray, values: FloatArray) -> FloatArray:
    """Mean of ``values`` per integer arrival bin; empty bins borrow bins +-1 (as the artifact)."""
    nb = MAX_BIN + 1
    keep = arr_pct <= MAX_BIN
    a, v = arr_pct[keep], values[keep]
    sums = np.bincount(a, weights=v, minlength=nb)[:nb]
    counts = np.bincount(a, minlength=nb)[:nb].astype(np.float64)
    out = np.full(nb, np.nan)
    has = counts > 0
    out[has] = sums[has] / counts[has]
    for x in np.flatnonzero(~has):
        lo, hi = max(0, x - 1), min(nb, x + 2)
        c = counts[lo:hi].sum()
        if c > 0:
            out[x] = sums[lo:hi].sum() / c
    return out


#: Where a pod went: (node index, GPU slots), or None when it was dropped.
Outcome = tuple[int, tuple[int, ...]] | None


class RecordedPolicy:
    """Replays recorded choices (one per ``choose`` call, in order) so the replay's metrics
    code can score placements made elsewhere (the live services, the scheduler's ``decide``)."""

    def __init__(self, name: str, outcomes: Sequence[Outcome]) -> None:
        self.name = name
        self._outcomes = list(outcomes)
        self._next = 0

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """The next recorded outcome as a placement of ``pod``."""
        got = self._outcomes[self._next]
        self._next += 1
        return None if got is None else NodeChoice.for_pod(got[0], got[1], pod)


class RecordingPolicy:
    """Wraps a policy and records each outcome, to compare runs pod by pod."""

    def __init__(self, inner: Policy) -> None:
        self.name = inner.name
        self.inner = inner
        self.outcomes: list[Outcome] = []

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """The inner policy's choice, recorded."""
        pl = self.inner.choose(state, pod)
        self.outcomes.append(None if pl is None else (pl.node, tuple(sorted(pl.gpus))))
        return pl


def replay_arrivals(
    nodes: Sequence[NodeSpec],
    workload: Sequence[PodDemand],
    policy: Policy,
    metric: ShapeDistribution,
    seed: int = 0,
    record_placements: bool = False,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> RunResult:
    """Arrival-only replay: each pod is placed or dropped; metrics logged after every arrival.

    ``metric`` is the shape distribution the fragmentation amount is measured against (the
    typical shapes of the original list). Every placement is re-validated by ``allocate``.
    """
    state = ClusterState.from_nodes(nodes)
    evaluator = FragEvaluator(metric, state.models)
    frag = evaluator.nodes(state)
    frag_total = float(frag.sum())
    cap = state.gpu_capacity_milli
    cpu_cap = float(state.cpu_cap.sum())
    n = len(workload)
    arrived = np.empty(n, dtype=np.int64)
    used = np.empty(n, dtype=np.float64)
    cpu_used = np.empty(n, dtype=np.float64)
    frag_log = np.empty(n, dtype=np.float64)
    decision = np.empty(n, dtype=np.int64)
    rejected = dict.fromkeys(POD_KINDS, 0)
    records: list[PlacementRecord] = []
    arrived_milli = 0
    used_milli = 0
    used_cpu = 0
    for i, pod in enumerate(workload):
        t0 = clock()
        placement = policy.choose(state, pod)
        decision[i] = clock() - t0
        arrived_milli += pod.gpu_request_milli
        if placement is None:
            rejected[pod.kind] += 1
        else:
            if not state.fits(placement, pod):
                raise RuntimeError(f"policy {policy.name} returned an invalid placement for {pod}")
            state.allocate(placement)
            used_milli += pod.gpu_request_milli
            used_cpu += pod.cpu_milli
            j = placement.node
            new = float(evaluator.nodes(state, np.array([j]))[0])
            frag_total += new - frag[j]
            frag[j] = new
            if record_placements:
                records.append(
                    PlacementRecord(pod.name, state.names[j], placement.gpus, placement.gpu_milli)
                )
        arrived[i] = arrived_milli
        used[i] = used_milli
        cpu_used[i] = used_cpu
        frag_log[i] = frag_total
    # round() to an integer bin, half to even, as pandas/numpy do in the artifact's analysis.
    arr_pct = np.round(arrived / cap * 100.0).astype(np.int64)
    return RunResult(
        policy=policy.name,
        seed=seed,
        pods=n,
        alloc_by_arrival=_binned(arr_pct, used / cap * 100.0),
        frag_by_arrival=_binned(arr_pct, frag_log / cap * 100.0),
        cpu_by_arrival=_binned(arr_pct, cpu_used / cpu_cap * 100.0),
        rejected=rejected,
        decision_ns=decision,
        final_alloc_pct=used_milli / cap * 100.0,
        placements=records,
    )


@dataclass
class PointStats:
    """Mean, sample sd and median of one metric over seeds."""

    mean: float
    sd: float
    median: float

    @classmethod
    def of(cls, values: Sequence[float]) -> PointStats:
        """Stats of ``values`` (NaNs ignored)."""
        arr = np.array([v for v in values if not math.isnan(v)], dtype=np.float64)
        if len(arr) == 0:
            return cls(math.nan, math.nan, math.nan)
        sd = float(arr.std(ddof=1)) if len(arr) > 1 else 0.0
        return cls(float(arr.mean()), sd, float(np.median(arr)))


@dataclass
class PolicySummary:
    """Aggregate of one policy's runs over seeds, in the shape of placement-eval.md's table."""

    policy: str
    seeds: list[int]
    alloc: dict[int, PointStats]
    frag: dict[int, PointStats]
    unallocated_gpus_100: PointStats
    first_lag_1pt: int | None
    rejected: dict[str, float]
    decision_p50_us: float
    decision_p99_us: float
    decision_max_us: float
    pods_per_run: float

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {
            "policy": self.policy,
            "seeds": self.seeds,
            "alloc_pct": {str(k): vars(v) for k, v in self.alloc.items()},
            "frag_amount_pct": {str(k): vars(v) for k, v in self.frag.items()},
            "unallocated_gpus_at_100": vars(self.unallocated_gpus_100),
            "first_arrival_lagging_1pt": self.first_lag_1pt,
            "rejected_mean": self.rejected,
            "decision_us": {
                "p50": self.decision_p50_us,
                "p99": self.decision_p99_us,
                "max": self.decision_max_us,
            },
            "pods_per_run": self.pods_per_run,
        }


def summarize(runs: Sequence[RunResult], total_gpus: int) -> PolicySummary:
    """Aggregate the runs of one policy."""
    if not runs:
        raise ValueError("no runs")
    alloc = {p: PointStats.of([r.alloc_at(p) for r in runs]) for p in ALLOC_POINTS}
    frag = {p: PointStats.of([r.frag_at(p) for r in runs]) for p in FRAG_POINTS}
    unalloc = PointStats.of([(100.0 - r.alloc_at(100)) / 100.0 * total_gpus for r in runs])
    stacked = np.vstack([r.alloc_by_arrival for r in runs])
    with warnings.catch_warnings():
        # Bins no run reached are all-NaN; their median is NaN by design.
        warnings.simplefilter("ignore", RuntimeWarning)
        median = np.nanmedian(stacked, axis=0)
    lag: int | None = None
    for x in range(len(median)):
        if not math.isnan(median[x]) and x - median[x] >= 1.0:
            lag = x
            break
    times = np.concatenate([r.decision_ns for r in runs]) / 1000.0
    rejected = {k: float(np.mean([r.rejected[k] for r in runs])) for k in POD_KINDS}
    return PolicySummary(
        policy=runs[0].policy,
        seeds=[r.seed for r in runs],
        alloc=alloc,
        frag=frag,
        unallocated_gpus_100=unalloc,
        first_lag_1pt=lag,
        rejected=rejected,
        decision_p50_us=float(np.percentile(times, 50)),
        decision_p99_us=float(np.percentile(times, 99)),
        decision_max_us=float(times.max()),
        pods_per_run=float(np.mean([r.pods for r in runs])),
    )


# ---------------------------------------------------------------------- dynamic mode


@dataclass
class DynamicResult:
    """Outcome of a replay with departures and a FIFO wait queue."""

    policy: str
    pods: int
    placed: int
    never_placed: int
    wait_s: FloatArray
    util_time: FloatArray
    util_gpu_pct: FloatArray
    decision_ns: IntArray

    def as_dict(self) -> dict[str, object]:
        """JSON-ready summary (the time series is downsampled to <= 200 points)."""
        waits = self.wait_s
        pct = {
            f"p{q}": float(np.percentile(waits, q)) if len(waits) else math.nan
            for q in (50, 90, 99)
        }
        step = max(1, len(self.util_time) // 200)
        return {
            "policy": self.policy,
            "pods": self.pods,
            "placed": self.placed,
            "never_placed": self.never_placed,
            "waited": int((waits > 0).sum()),
            "wait_s": {**pct, "max": float(waits.max()) if len(waits) else math.nan},
            "gpu_util_pct_time_weighted": _time_weighted(self.util_time, self.util_gpu_pct),
            "gpu_util_pct_peak": float(self.util_gpu_pct.max()) if len(self.util_gpu_pct) else 0,
            "decision_us": {
                "p50": float(np.percentile(self.decision_ns, 50) / 1000),
                "p99": float(np.percentile(self.decision_ns, 99) / 1000),
            },
            "series": {
                "t": self.util_time[::step].tolist(),
                "gpu_util_pct": self.util_gpu_pct[::step].tolist(),
            },
        }


def _time_weighted(t: FloatArray, v: FloatArray) -> float:
    if len(t) < 2 or t[-1] <= t[0]:
        return float(v.mean()) if len(v) else 0.0
    return float(np.sum(np.diff(t) * v[:-1]) / (t[-1] - t[0]))


def replay_dynamic(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    policy: Policy,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> DynamicResult:
    """Replay with the trace's creation/deletion times.

    A pod arrives at its creation time and runs for ``deletion - creation`` seconds from the
    moment it is placed. A pod that does not fit joins a FIFO queue; whenever a pod departs the
    queue is scanned in order and every pod that now fits is placed (later pods may pass an
    earlier one that still does not fit). Pods still queued at the end are ``never_placed``.
    """
    state = ClusterState.from_nodes(nodes)
    cap = state.gpu_capacity_milli
    order = sorted(range(len(pods)), key=lambda i: (pods[i].creation_time, pods[i].name))
    departures: list[tuple[float, int, int]] = []  # (time, seq, pod index)
    running: dict[int, NodeChoice] = {}
    queue: deque[int] = deque()
    waits: list[float] = []
    times: list[float] = []
    utils: list[float] = []
    decisions: list[int] = []
    seq = 0

    def try_place(i: int, now: float) -> bool:
        nonlocal seq
        pod = pods[i].demand
        t0 = clock()
        placement = policy.choose(state, pod)
        decisions.append(clock() - t0)
        if placement is None:
            return False
        state.allocate(placement)
        running[i] = placement
        duration = max(0, pods[i].deletion_time - pods[i].creation_time)
        heapq.heappush(departures, (now + duration, seq, i))
        seq += 1
        waits.append(now - pods[i].creation_time)
        return True

    def log(now: float) -> None:
        times.append(now)
        utils.append(state.gpu_used_milli / cap * 100.0)

    def drain_queue(now: float) -> None:
        for _ in range(len(queue)):
            i = queue.popleft()
            if not try_place(i, now):
                queue.append(i)

    k = 0
    while k < len(order) or departures:
        next_arrival = pods[order[k]].creation_time if k < len(order) else math.inf
        if departures and departures[0][0] <= next_arrival:
            now, _, i = heapq.heappop(departures)
            state.release(running.pop(i))
            # Only retry the queue once all departures at this instant are processed.
            while departures and departures[0][0] == now:
                _, _, j = heapq.heappop(departures)
                state.release(running.pop(j))
            drain_queue(now)
            log(now)
        else:
            i = order[k]
            k += 1
            now = float(next_arrival)
            # A newcomer that fits is placed even if older pods wait (they did not fit); one
            # that does not fit queues behind them.
            if not try_place(i, now):
                queue.append(i)
            log(now)
    return DynamicResult(
        policy=policy.name,
        pods=len(pods),
        placed=len(waits),
        never_placed=len(queue),
        wait_s=np.array(waits, dtype=np.float64),
        util_time=np.array(times, dtype=np.float64),
        util_gpu_pct=np.array(utils, dtype=np.float64),
        decision_ns=np.array(decisions, dtype=np.int64),
    )
