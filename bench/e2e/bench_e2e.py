"""End-to-end speed of the whole stack against the floor of its own servers (issue 14).

``python bench/e2e/bench_e2e.py [--quick] [--out PATH]``: embedded NATS (JetStream, a monitor
port for /varz) and Redis (AOF, ``appendfsync always``), every service as its own process, a
simulated fleet in one fleet process (``xpupool.telemetry_collector.fleet``), and this process
as the load generator. Each scenario measures, in the same run on the same servers:

- the floor: NATS request/reply through a responder process that runs one Redis Lua
  reservation per message, serial and at the closed loop's concurrency. It takes turns with
  what it is compared with (``--rounds`` slices each: floor, closed loop, floor, ...; serial
  floor, serial jobs, ...), so that both see the same machine: on a shared one the speed drifts
  by tens of percent within minutes, and a floor measured once before the loop made the ratio
  move with that drift. The ratios are of the slices' means; each round's are in the JSON;
- closed loop: workers submit a job, wait for its outcome, release the lease (whole devices,
  shares and 2-device gangs mixed); sustained grants/s;
- open loop: a constant-rate generator at 25/50/80 % of the closed-loop rate; submit -> grant
  latency percentiles; before it, one job at a time, and how many of those the scheduler
  placed on its kept copy of the ledger (its ``xpupool_scheduler_admission_views_total``);
- CPU seconds per 1,000 grants and resident memory per service, per server and for the load
  generator itself (/proc), Redis commands per
  grant (INFO commandstats delta), NATS messages per grant (/varz delta).

``--workload trace`` runs one scenario on the Alibaba GPU trace instead (``trace_workload``): its
1,213 GPU nodes with their models as the fleet, and its pods, shuffled, as the jobs: whole GPUs,
gangs of up to eight, compute shares, model constraints and CPU-only pods in the trace's
proportions, each built as the live replay builds it.

``--fleet-busy-share F`` makes that share of each simulated node's devices report a moving
utilisation every heartbeat (``XPUPOOL_FLEET_BUSY_SHARE``), as devices running long jobs do:
each change enters the ledger's change log, which the scheduler's kept copy follows.

``--occupied F`` first holds about that share of the fleet's devices with leases that outlive
the run (the workload's own mix, under a tenant of their own, never released), as a production
pool is mostly busy: the loops are then measured with thousands of live leases in the ledger,
the scheduler's copy and the lease-manager's gauges.

``--serial-costs`` also logs every Redis command during the serial run (SLOWLOG at 0 µs) and
reports Redis's own time per job by command and ledger script; each process's CPU per serial job
is always reported.

``--profile DIR`` attaches py-spy to every service during the closed loop and writes one
profile per service (a flame graph SVG by default, ``--profile-format raw`` for collapsed
stacks), plus ``top.txt``: each service's hottest functions by inclusive and own samples. The
serial run and each open-loop rate are profiled the same way, into ``DIR/<scenario>/serial`` and
``DIR/<scenario>/open-<percent>`` (py-spy takes CPU of its own: the open loop's latencies and
CPU figures of a profiled run are not comparable with an unprofiled one's).

``--latencies DIR`` writes each open phase's jobs (submit wall time, seconds to the grant), its
AOF rewrites and Redis's own latency events of 1 ms and more (``LATENCY HISTORY``: the AOF's
fsyncs, slow commands and scripts, the rewrite's fork; the monitor is on only during the phase)
to ``DIR/<scenario>-open-<percent>.json``; ``bench/e2e/timeline.py DIR`` prints them second by
second, to tell a tail made of queueing from one made of stalls.

Correctness first: every submitted job must get exactly one outcome and the ledger audit must be
clean after every scenario, or the run fails (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import uvloop
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from xpupool.bus.connection import connect_client, ensure_streams
from xpupool.bus.lifecycle import PARENT_PID_ENV, freeze_heap
from xpupool.client import XpupoolClient, connected
from xpupool.contracts import (
    AllocationGranted,
    DeviceDemand,
    GangSpec,
    JobRequested,
)
from xpupool.contracts import subjects as s
from xpupool.devices.simulated import parse_profile
from xpupool.devstack.servers import NatsServer, RedisServer, free_port, free_ports
from xpupool.devstack.stack import ServiceProcess, Stack
from xpupool.ledger import Ledger
from xpupool.ledger.audit import audit
from xpupool.ledger.ledger import SCRIPTS, script_source
from xpupool.replay.live import simulated_trace
from xpupool.replay.requests import job_request
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods
from xpupool.scheduler.metrics import CYCLE_PHASES
from xpupool.telemetry_collector.fleet import FleetNode, format_fleet

TENANT = "bench"
SERVERS = ("nats-server", "redis-server")
PROFILES = ("8xA100-80GB", "8xAscend910B", "8xT4", "8xMLU370-X4")
FLOOR_SUBJECT = "bench.floor"
# The load generator's one tenant stands for the many clients a pool serves: the default
# admission limit of a tenant (1,000 requests/s, 20,000 pending) would turn its requests away
# (``rate_limited``) once the stack grants faster than that, and measure the limiter. Otherwise
# the queue file is the default: one queue per tenant, no quota.
BENCH_QUEUES = "tenant_limits:\n  default: {rate_per_s: 0, max_pending: -1}\n"
# One reservation, as the ledger's scripts do it: check, take, and (to keep the key steady)
# give back; every call writes, so AOF fsyncs it like a real reservation.
FLOOR_LUA = """
local free = tonumber(redis.call('HGET', KEYS[1], 'free') or '1000000')
if free < tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'free', free - tonumber(ARGV[1]), 'last', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'free', tonumber(ARGV[1]))
return 1
"""
RESPONDER = f"""
import asyncio, sys
import uvloop
from nats.aio.client import Client
from redis.asyncio import Redis
async def main():
    redis = Redis.from_url(sys.argv[2])
    script = redis.register_script({FLOOR_LUA!r})
    nc = Client()
    await nc.connect(sys.argv[1])
    async def on(msg):
        ok = await script(keys=["bench:floor:dev"], args=[1, msg.data])
        await msg.respond(b"1" if ok else b"0")
    await nc.subscribe({FLOOR_SUBJECT!r}, cb=on)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
uvloop.run(main())
"""


@dataclass
class MonitoredNats(NatsServer):
    """nats-server with the HTTP monitor (``/varz``) on its own port."""

    monitor_port: int = 0  # 0: a free port other than the server's own

    def __post_init__(self) -> None:
        if not self.monitor_port:
            self.monitor_port = next(port for port in free_ports(2) if port != self.port)

    def command(self) -> list[str]:
        return [*super().command(), "-m", str(self.monitor_port)]

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/varz", timeout=5) as r:
            data: dict[str, Any] = json.load(r)
            return data


async def start_slowlog(redis: Redis) -> None:
    """Log every command with its run time (``--serial-costs``; it costs Redis a little)."""
    await redis.config_set("slowlog-log-slower-than", 0)
    await redis.config_set("slowlog-max-len", 100_000)
    await redis.slowlog_reset()


async def redis_time_per_job(redis: Redis, jobs: int) -> dict[str, dict[str, float]]:
    """Redis's own time per job by command since ``start_slowlog``, a ledger script by its name
    (a script's time includes the commands it calls, which the log lists too): calls and
    microseconds per job, the costliest first."""
    names = {
        hashlib.sha1(script_source(name).encode()).hexdigest(): f"script {name}" for name in SCRIPTS
    }
    entries = await redis.slowlog_get(100_000)
    await redis.config_set("slowlog-log-slower-than", 10_000)
    totals: dict[str, list[float]] = {}
    for entry in entries:
        command = [_text(part) for part in entry["command"].split()[:2]]
        name = command[0].lower()
        if name == "evalsha" and len(command) > 1:
            name = names.get(command[1], f"script {command[1][:8]}")
        calls_us = totals.setdefault(name, [0, 0])
        calls_us[0] += 1
        calls_us[1] += entry["duration"]
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    return {
        name: {"calls": calls / jobs, "us": us / jobs, "us_per_call": us / max(1, calls)}
        for name, (calls, us) in ranked[:12]
    }


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def admission_views(port: int) -> dict[str, float]:
    """The scheduler's lone arrivals placed on its kept copy, by view (``kept``/``changed``),
    its change-log reads carried by a commit and used by the next batch (``read_carried``,
    ``read_used``), how many scheduling cycles it has run (``cycles``: under load, a job
    that had to wait turns placement on admission off until a cycle runs) and their time in all
    (``cycle_s``) and by phase (``cycle_read_s``, ``cycle_decide_s``, ``cycle_commit_s``), and its
    cyclic collector's passes by generation (``gc_0``, ``gc_1``, ``gc_2``)."""
    return scheduler_counts(exposition(port))


def exposition(port: int) -> str:
    """One scrape of a service's metrics on this machine."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def scheduler_counts(text: str) -> dict[str, float]:
    """``admission_views``'s figures from one scrape of the scheduler's exposition."""
    counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "xpupool_scheduler_admission_views_total":
                counts[sample.labels["view"]] = sample.value
            elif sample.name == "xpupool_scheduler_carried_reads_total":
                counts["read_" + sample.labels["step"]] = sample.value
            elif sample.name == "xpupool_scheduler_cycle_duration_seconds_count":
                counts["cycles"] = sample.value
            elif sample.name == "xpupool_scheduler_cycle_duration_seconds_sum":
                counts["cycle_s"] = sample.value
            elif sample.name == "xpupool_scheduler_cycle_phase_seconds_sum":
                counts[f"cycle_{sample.labels['phase']}_s"] = sample.value
            elif sample.name == "python_gc_collections_total":
                counts["gc_" + sample.labels["generation"]] = sample.value
    return counts


def grant_order_counts(text: str) -> dict[str, float]:
    """One lease-manager's later events that waited for their lease's grant to be stored
    (``grant_waits``) and those that went after a copy of it (``grant_copies``: the grant never
    came, which should stay at 0 while the scheduler runs), from one scrape of its exposition."""
    names = {
        "xpupool_grant_waits_total": "grant_waits",
        "xpupool_grant_copies_total": "grant_copies",
    }
    return {
        names[sample.name]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    }


def service_counts(scheduler_port: int, lease_manager_ports: Sequence[int]) -> dict[str, float]:
    """``admission_views``'s figures (none without the scheduler's port) and the lease-managers'
    ``grant_order_counts``, summed over the replicas."""
    counts = admission_views(scheduler_port) if scheduler_port else {}
    for port in lease_manager_ports:
        for name, value in grant_order_counts(exposition(port)).items():
            counts[name] = counts.get(name, 0.0) + value
    return counts


def grant_order_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two ``service_counts`` scrapes: later events of a lease (its release, renewal,
    expiry) that waited for its grant, published a loop turn after its answer, to be stored
    first, and those that went after a copy of the grant instead."""
    return {
        name: after.get(name, 0.0) - before.get(name, 0.0)
        for name in ("grant_waits", "grant_copies")
    }


def cycle_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The scheduling cycles run between two ``admission_views`` scrapes and their mean time,
    in all and by phase (the ledger read, the decisions, the commits): on a busy pool every job
    waits for one."""
    cycles = after.get("cycles", 0.0) - before.get("cycles", 0.0)

    def mean_ms(name: str) -> float:
        spent_s = after.get(name, 0.0) - before.get(name, 0.0)
        return 1000 * spent_s / cycles if cycles else 0.0

    return {
        "cycles": cycles,
        "cycle_ms_mean": mean_ms("cycle_s"),
        **{f"cycle_{phase}_ms_mean": mean_ms(f"cycle_{phase}_s") for phase in CYCLE_PHASES},
    }


def cycle_time(figures: Mapping[str, Any]) -> str:
    """A cycle's mean time as the table prints it: in all, then read / decide / commit."""
    phases = " / ".join(f"{figures.get(f'cycle_{p}_ms_mean', 0.0):.1f}" for p in CYCLE_PHASES)
    return f"{figures['cycle_ms_mean']:.1f} ms each, read / decide / commit {phases}"


def kept_copy_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Lone arrivals placed on the kept copy between two ``admission_views`` scrapes, and of
    those the ones the ledger refused for a changed view (the scheduler counts the two apart:
    ``kept`` are those the ledger took)."""
    took = after.get("kept", 0.0) - before.get("kept", 0.0)
    refused = after.get("changed", 0.0) - before.get("changed", 0.0)
    # Batches that decided on a read the previous batch's commit carried (read_along).
    carried = after.get("read_used", 0.0) - before.get("read_used", 0.0)
    return {
        "decided_on_kept_copy": took + refused,
        "view_changed": refused,
        "decided_on_carried_read": carried,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


REWRITE_STARTED = "Background append only file rewriting started"
REWRITE_ENDED = "Background AOF rewrite terminated"


def aof_rewrite_windows(log: Path, since: float, until: float) -> list[tuple[float, float]]:
    """The AOF rewrites Redis's own log (its main process's lines, stamped to the millisecond
    in local time, as ``datetime`` reads them) shows overlapping ``since``..``until`` (wall
    clock), each clipped to it; one still running at ``until`` ends there."""
    windows: list[tuple[float, float]] = []
    started: float | None = None
    for line in log.read_text(errors="replace").splitlines():
        _, _, rest = line.partition(":M ")
        stamp, _, message = rest.partition(" * ")
        if not message.startswith((REWRITE_STARTED, REWRITE_ENDED)):
            continue
        try:
            at = datetime.strptime(stamp.strip(), "%d %b %Y %H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        if message.startswith(REWRITE_STARTED):
            started = at
        elif started is not None:
            windows.append((started, at))
            started = None
    if started is not None:
        windows.append((started, until))
    return [(max(a, since), min(b, until)) for a, b in windows if b > since and a < until]


def outside_rewrites(
    granted: list[tuple[float, float]], windows: list[tuple[float, float]]
) -> list[float]:
    """The latencies of the jobs (``Load.granted``: wall-clock submit, seconds to the grant)
    whose submit -> grant overlapped no rewrite."""
    return [
        latency
        for start, latency in granted
        if not any(start < b and start + latency > a for a, b in windows)
    ]


def p99_ms_outside_rewrites(
    granted: list[tuple[float, float]], windows: list[tuple[float, float]], counted: int
) -> float | None:
    """The p99 (ms) of the jobs that overlapped no rewrite; None when none did, or when Redis
    counted ``counted`` rewrites (INFO) but its log showed none of them in the phase (a server
    that words its log otherwise): the figure would then silently be the whole phase's."""
    calm = outside_rewrites(granted, windows)
    if not calm or (counted > 0 and not windows):
        return None
    return 1000 * percentile(calm, 0.99)


def quiet_collector() -> int:
    """Before a measured slice: collect now, then keep this process's heap (every job id
    and latency of the run so far) out of the cyclic collector's view, as the services do
    (``freeze_heap``). At CPython's defaults a full pass over that heap stalled the load
    generator for 90-107 ms within measured phases: the replies of every job in flight waited
    for it, and the open loop then sent the submissions due meanwhile as one burst, all of it
    counted as the stack's latency. Returns the full passes so far (``full_passes_since``)."""
    freeze_heap()
    return int(gc.get_stats()[2]["collections"])


def full_passes_since(mark: int) -> int:
    """This process's full collections since ``quiet_collector`` returned ``mark``."""
    return int(gc.get_stats()[2]["collections"]) - mark


def proc_usage(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and resident bytes of one process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def proc_syscalls(pid: int) -> tuple[int, int]:
    """Read and write system calls of one process so far (socket sends and receives among
    them), from /proc; (0, 0) where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        return int(fields["syscr"]), int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def host_steal_s() -> float:
    """CPU seconds the hypervisor has given this VM's cores to others so far (``steal`` in
    /proc/stat, every core together); 0.0 where the kernel does not count it. On a shared machine
    it is the noise that moves the floor and the stack apart: a slice that lost a share of its
    cores is no measure of either."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class StealMeter:
    """Cores lost to the hypervisor (``host_steal_s``) over the slices it was started and
    stopped around."""

    def __init__(self) -> None:
        self.steal_s = self.wall_s = 0.0
        self._at = (0.0, 0.0)

    def start(self) -> None:
        self._at = (host_steal_s(), time.monotonic())

    def stop(self) -> None:
        steal0, wall0 = self._at
        self.steal_s += host_steal_s() - steal0
        self.wall_s += time.monotonic() - wall0

    @property
    def cores(self) -> float:
        return self.steal_s / self.wall_s if self.wall_s > 0 else 0.0


async def redis_commands(redis: Redis) -> Counter[str]:
    """Calls per Redis command so far (INFO commandstats)."""
    stats = await redis.info("commandstats")
    return Counter(
        {
            k.removeprefix("cmdstat_"): int(v["calls"])
            for k, v in stats.items()
            if isinstance(v, dict)
        }
    )


def start_profilers(
    pids: dict[str, int], directory: Path, fmt: str
) -> list[subprocess.Popen[bytes]]:
    """py-spy attached to each service until ``stop_profilers`` (raw stacks kept for
    ``top.txt``)."""
    directory.mkdir(parents=True, exist_ok=True)
    py_spy = Path(sys.executable).parent / "py-spy"
    procs = []
    for name, pid in pids.items():
        for form, suffix in {fmt: {"flamegraph": "svg"}.get(fmt, "txt"), "raw": "txt"}.items():
            out = directory / f"{name}.{form}.{suffix}"
            procs.append(
                subprocess.Popen(  # noqa: ASYNC220  (started before the measured loop)
                    [
                        str(py_spy),
                        "record",
                        "--pid",
                        str(pid),
                        "--rate",
                        "250",
                        "--nonblocking",
                        "--format",
                        form,
                        "--output",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            if form == "raw":
                break
    return procs


async def stop_profilers(procs: list[subprocess.Popen[bytes]], directory: Path | None) -> None:
    """Stop the profilers (py-spy writes its profile on SIGINT) and write ``top.txt``."""
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        await asyncio.to_thread(p.wait)
    if directory:
        (directory / "top.txt").write_text(profile_top(directory) + "\n")


def profile_top(directory: Path, n: int = 25) -> str:
    """Each service's hottest functions from its collapsed stacks: inclusive and own share."""
    out = []
    for raw in sorted(directory.glob("*.raw.txt")):
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            samples = int(count)
            frames = [
                f.split(" (")[0] + " (" + f.rsplit("/", 1)[-1] if " (" in f else f
                for f in stack.split(";")
            ]
            total += samples
            for f in set(frames):
                inclusive[f] += samples
            own[frames[-1]] += samples
        out.append(f"== {raw.name.split('.')[0]}: {total} samples")
        out.append("-- inclusive")
        out += [f"{100 * c / max(1, total):6.1f}%  {f}" for f, c in inclusive.most_common(n)]
        out.append("-- own")
        out += [f"{100 * c / max(1, total):6.1f}%  {f}" for f, c in own.most_common(n)]
    return "\n".join(out)


def fleet(devices: int) -> list[FleetNode]:
    return [
        FleetNode(f"bench-n{i:05d}", PROFILES[i % len(PROFILES)], 256_000, 2 * 1024 * 1024)
        for i in range(max(1, devices // 8))
    ]


def job(job_id: str, i: int) -> JobRequested:
    """Mixed shapes: 1/2 shares, 1/4 whole devices, 1/4 two-device gangs."""
    kind = i % 4
    if kind in (0, 2):
        return JobRequested(
            job_id=job_id, tenant=TENANT, device=DeviceDemand(memory_mib=1000), max_wait_s=30
        )
    if kind == 1:
        return JobRequested(job_id=job_id, tenant=TENANT, max_wait_s=30)
    return JobRequested(job_id=job_id, tenant=TENANT, count=2, gang=GangSpec(), max_wait_s=30)


@dataclass(frozen=True)
class Workload:
    """What a scenario runs: its simulated nodes, its jobs (the ``i``-th request, by id) and
    the environment the services need for them."""

    nodes: list[FleetNode]
    make_job: Callable[[str, int], JobRequested]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return sum(count for n in self.nodes for count, _ in parse_profile(n.profile))


def synthetic_workload(devices: int) -> Workload:
    """``devices`` over nodes of eight, four vendors in turn; ``job``'s mix."""
    return Workload(fleet(devices), job)


TRACE = "alibaba-gpu-v2023"


def trace_workload(work: Path, seed: int = 42) -> Workload:
    """The Alibaba GPU trace (``openb``): its 1,213 GPU nodes with their models, and its 8,152
    pods, shuffled with ``seed``, as the requests in turn (cycling): whole GPUs, gangs of up to
    eight on one node, shares of a GPU's compute, model constraints (``gpu_spec``) and CPU-only
    pods, in the trace's proportions. A pod becomes a request as in the live replay
    (``xpupool.replay.requests.job_request``), waiting at most 30 s as the synthetic jobs do.
    The trace's creation times are not used: arrivals are the open loop's (see ``--arrivals``).
    """
    found = find_trace_dir(Path(__file__).resolve())
    if found is None:
        raise SystemExit(f"--workload trace: no ../shared/traces/{TRACE} beside the repository")
    nodes = [n for n in load_nodes(found / "openb_node_list_gpu_node.csv") if n.num_gpu]
    pods = [p.demand for p in load_pods(found / "openb_pod_list_default.csv")]
    random.Random(seed).shuffle(pods)
    catalog = work / "trace-catalog.toml"
    catalog.parent.mkdir(parents=True, exist_ok=True)
    fleet_nodes, names = simulated_trace(nodes, pods, catalog)

    def make_job(job_id: str, i: int) -> JobRequested:
        request = job_request(job_id, pods[i % len(pods)], names, tenant=TENANT)
        waiting: JobRequested = msgspec.structs.replace(request, max_wait_s=30)
        return waiting

    return Workload(fleet_nodes, make_job, {"XPUPOOL_CATALOG": str(catalog)})


@dataclass
class Tally:
    """Every outcome the client saw, per job: exactly one each is the correctness check."""

    outcomes: Counter[str] = field(default_factory=Counter)
    submitted: list[str] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)

    def problems(self) -> list[str]:
        lost = [j for j in self.submitted if self.outcomes[j] == 0]
        dup = [j for j, n in self.outcomes.items() if n > 1]
        out = []
        if lost:
            out.append(f"{len(lost)} jobs without outcome, e.g. {lost[:3]}")
        if dup:
            out.append(f"{len(dup)} jobs with more than one outcome, e.g. {dup[:3]}")
        return out


class Load:
    """The load generator: one client, every outcome counted."""

    def __init__(
        self,
        client: XpupoolClient,
        prefix: str,
        make_job: Callable[[str, int], JobRequested] = job,
        *,
        by_request: bool = True,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.make_job = make_job
        self.by_request = by_request
        self.tally = Tally()
        self.n = 0
        self.granted: list[tuple[float, float]] = []
        """Each granted job since the last reset: its submit (wall clock, to set against Redis's
        log) and its submit -> grant seconds (monotonic clock)."""
        client.listen(self._on_event)

    @property
    def latencies(self) -> list[float]:
        """The submit -> grant seconds of the jobs granted since the last reset."""
        return [latency for _, latency in self.granted]

    def _on_event(self, event: object) -> None:
        job_id = getattr(event, "job_id", None)
        name = type(event).__name__
        if name in ("AllocationGranted", "JobRejected", "JobTimedOut", "JobCancelled"):
            assert isinstance(job_id, str)
            self.tally.outcomes[job_id] += 1
            self.tally.kinds[name] += 1

    async def one(self) -> bool:
        """Submit one job, wait for its outcome, release its lease; True if granted."""
        i = self.n
        self.n += 1
        job_id = f"{self.prefix}-{i:07d}"
        self.tally.submitted.append(job_id)
        t0, wall0 = time.perf_counter(), time.time()
        outcome = await self.client.submit_and_wait(
            self.make_job(job_id, i), timeout_s=60, by_request=self.by_request
        )
        if not isinstance(outcome, AllocationGranted):
            return False
        self.granted.append((wall0, time.perf_counter() - t0))
        await self.client.release(outcome.lease_id, outcome.fencing_token)
        return True

    async def closed(self, concurrency: int, duration_s: float) -> float:
        """Grants per second with ``concurrency`` jobs in flight (``rate_in_window``)."""
        return await rate_in_window(self.one, concurrency, duration_s)

    async def open(
        self,
        rate: float,
        duration_s: float,
        poisson: random.Random | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> list[float]:
        """Submit at ``rate`` (not slowed by the system): evenly spaced, or with ``poisson``
        exponential gaps of the same mean (many independent clients); grant latencies.
        ``clock`` and ``sleep`` keep the schedule (a test's own time, which a loaded host's
        scheduling does not move)."""
        self.granted = []
        tasks = []
        t0 = clock()
        due = 0.0
        for _ in range(max(1, int(rate * duration_s))):
            delay = t0 + due - clock()
            if delay > 0:
                await sleep(delay)
            tasks.append(asyncio.create_task(self.one()))
            due += poisson.expovariate(rate) if poisson is not None else 1 / rate
        await asyncio.gather(*tasks)
        return self.latencies


OCCUPANT = "bench-occupant"


async def occupy(
    client: XpupoolClient,
    make_job: Callable[[str, int], JobRequested],
    devices: int,
    share: float,
    concurrency: int = 32,
) -> dict[str, float]:
    """Hold about ``share`` of ``devices`` with leases that outlive the run: the workload's
    jobs, under ``OCCUPANT``, with a term of an hour, never released, until that many devices
    hold at least one of them (or 100 requests in a row found no room)."""
    held: set[str] = set()
    leases = 0
    misses = 0
    n = 0
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal leases, misses, n
        while len(held) < share * devices and misses < 100:
            i, n = n, n + 1
            request = msgspec.structs.replace(
                make_job(f"occupant-{i:07d}", i), tenant=OCCUPANT, lease_ttl_s=3600, max_wait_s=1
            )
            outcome = await client.submit_and_wait(request, timeout_s=60)
            if isinstance(outcome, AllocationGranted):
                leases += 1
                misses = 0
                held.update(s.device_id for s in outcome.slices)
            else:
                misses += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {
        "leases": leases,
        "devices_held": len(held),
        "share_held": len(held) / max(devices, 1),
        "seconds": time.perf_counter() - started,
    }


async def rate_in_window(
    step: Callable[[], Awaitable[bool]], concurrency: int, duration_s: float
) -> float:
    """``concurrency`` workers each running ``step`` after ``step`` for ``duration_s``: the
    successful steps completed within the window, over its length. Those still in flight at
    its end finish uncounted: a short slice must not count its drain as time at full
    concurrency."""
    stop = time.perf_counter() + duration_s
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            # Await first: ``done += await ...`` would read done before the await and lose the
            # other workers' increments.
            ok = await step()
            if ok and time.perf_counter() <= stop:
                done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / duration_s


async def floor_serial(nc: Client, count: int) -> list[float]:
    """The floor one request at a time: each round trip's seconds."""
    serial = []
    for i in range(count):
        t0 = time.perf_counter()
        await nc.request(FLOOR_SUBJECT, str(i).encode(), timeout=5)
        serial.append(time.perf_counter() - t0)
    return serial


async def floor_rate(nc: Client, concurrency: int, duration_s: float) -> float:
    """The floor's rate with ``concurrency`` requests in flight, counted as the closed loop's
    is (``rate_in_window``)."""

    async def round_trip() -> bool:
        await nc.request(FLOOR_SUBJECT, b"x", timeout=5)
        return True

    return await rate_in_window(round_trip, concurrency, duration_s)


class Usage:
    """What the services and servers spent (CPU, Redis commands, NATS messages) over the
    slices of a run it was started and stopped around, the floor's slices between left out."""

    def __init__(self, pids: dict[str, int], redis: Redis, nats: MonitoredNats) -> None:
        self.pids, self.redis, self.nats = pids, redis, nats
        self.cpu_s: dict[str, float] = dict.fromkeys(pids, 0.0)
        self.syscalls: dict[str, tuple[int, int]] = dict.fromkeys(pids, (0, 0))
        self.commands: Counter[str] = Counter()
        self.nats_in = self.nats_out = 0
        self._cpu0: dict[str, float] = {}
        self._sys0: dict[str, tuple[int, int]] = {}
        self._cmd0: Counter[str] = Counter()
        self._varz0: dict[str, Any] = {}
        self.steal = StealMeter()

    async def start(self) -> None:
        self.steal.start()
        self._cpu0 = {k: proc_usage(pid)[0] for k, pid in self.pids.items()}
        self._sys0 = {k: proc_syscalls(pid) for k, pid in self.pids.items()}
        self._cmd0, self._varz0 = await redis_commands(self.redis), self.nats.varz()

    async def stop(self) -> None:
        for k, pid in self.pids.items():
            self.cpu_s[k] += proc_usage(pid)[0] - self._cpu0[k]
            (r0, w0), (r1, w1) = self._sys0[k], proc_syscalls(pid)
            reads, writes = self.syscalls[k]
            self.syscalls[k] = (reads + r1 - r0, writes + w1 - w0)
        varz = self.nats.varz()
        self.commands += await redis_commands(self.redis) - self._cmd0
        self.nats_in += varz["in_msgs"] - self._varz0["in_msgs"]
        self.nats_out += varz["out_msgs"] - self._varz0["out_msgs"]
        self.steal.stop()

    def cpu_ms_per_job(self, jobs: int) -> dict[str, float]:
        """Each process's CPU milliseconds per job over the measured slices."""
        return {k: 1000 * s / max(1, jobs) for k, s in self.cpu_s.items()}

    def syscalls_per_job(self, jobs: int) -> dict[str, dict[str, float]]:
        """Each process's read and write system calls per job over the measured slices: on
        loopback a socket write also delivers to, and wakes, its reader."""
        return {
            k: {"read": r / max(1, jobs), "write": w / max(1, jobs)}
            for k, (r, w) in self.syscalls.items()
        }


def spawn_fleet(
    stack: Stack, nodes: list[FleetNode], heartbeat_s: float, busy_share: float = 0.0
) -> ServiceProcess:
    path = stack.workdir / "fleet.csv"
    path.write_text(format_fleet(nodes), encoding="utf-8")
    env = stack.base_env()
    env.update(
        XPUPOOL_SIMULATED_NODES=str(path),
        XPUPOOL_SAMPLE_INTERVAL_S=str(heartbeat_s),
        XPUPOOL_FLEET_BUSY_SHARE=str(busy_share),
    )
    # It stops when the bench is gone, killed included, as the stack's own services do.
    env[PARENT_PID_ENV] = str(os.getpid())
    log_path = stack.workdir / "telemetry-fleet.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "xpupool.telemetry_collector.fleet"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    service = ServiceProcess("telemetry-fleet", process, env, log_path)
    stack.services.append(service)
    return service


@dataclass
class Scenario:
    name: str
    devices: int
    replicas: int = 1
    open_loop: bool = False
    trace: bool = False  # the trace's nodes and pods (trace_workload), not ``devices``


async def run_scenario(sc: Scenario, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    nats = MonitoredNats(work / sc.name / "nats")
    nats.start()
    # Made once NATS listens, so that Redis's free port cannot be the one NATS was given.
    redis_server = RedisServer(work / sc.name / "redis")
    redis_server.start()
    # Started before any load is measured: blocking this loop for it costs nothing measured.
    responder = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", RESPONDER, nats.url, redis_server.url],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    workload = trace_workload(work / sc.name) if sc.trace else synthetic_workload(sc.devices)
    # One scheduler's metrics (where the open loop runs): replicas would share the port.
    metrics_port = free_port() if sc.replicas == 1 else 0
    # Every lease-manager's, each on a port of its own: their grant waits and copies, summed.
    lease_manager_ports = [free_port() for _ in range(sc.replicas)]

    def scrape() -> dict[str, float]:
        return service_counts(metrics_port, lease_manager_ports)

    queues = work / sc.name / "queues.yaml"
    queues.parent.mkdir(parents=True, exist_ok=True)
    queues.write_text(BENCH_QUEUES)
    stack = Stack(
        nodes=[],
        nats_url=nats.url,
        redis_url=redis_server.url,
        schedulers=sc.replicas,
        workdir=work / sc.name / "stack",
        extra_env={
            "XPUPOOL_LOG_LEVEL": "warning",
            "XPUPOOL_NODE_GRACE_S": "600",
            "XPUPOOL_SCHEDULER_METRICS_PORT": str(metrics_port),
            "XPUPOOL_LEASE_MANAGER_METRICS_PORT": str(lease_manager_ports[0]),
            "XPUPOOL_QUEUE_CONFIG": str(queues),
            **workload.env,
        },
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "scenario": sc.name,
        "devices": workload.devices,
        "replicas": sc.replicas,
        "workload": "trace" if sc.trace else "synthetic",
        "submit": args.submit,
    }
    redis = Redis.from_url(redis_server.url)
    floor_nc: Client | None = None
    try:
        assert responder.stdout is not None
        if responder.stdout.readline().strip() != b"ready":
            raise RuntimeError("floor responder did not start")
        stack.start()
        for port in lease_manager_ports[1:]:
            stack.spawn("lease-manager", XPUPOOL_LEASE_MANAGER_METRICS_PORT=str(port))
        nodes = workload.nodes
        spawn_fleet(stack, nodes, args.heartbeat_s, args.fleet_busy_share)
        ledger = Ledger(redis, stack.namespace)
        deadline = time.monotonic() + 180
        while len(await ledger.nodes()) < len(nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"fleet did not register; logs:\n{stack.logs()}")
            await asyncio.sleep(0.5)
        result["devices_registered"] = sum(len(n.devices) for n in await ledger.nodes())
        await stack.wait_until_pulling(timeout_s=60)
        floor_nc = await connect_client(nats.url, name="bench-floor")
        rounds = max(1, args.rounds)
        async with connected(nats.url) as client:
            await ensure_streams(client.js, s.STREAMS)
            load = Load(
                client,
                f"{sc.name}-{os.getpid()}",
                workload.make_job,
                by_request=args.submit == "request",
            )
            if args.occupied > 0:
                result["occupied"] = occupied = await occupy(
                    client, workload.make_job, workload.devices, args.occupied
                )
                print(
                    f"  {sc.name}: {occupied['leases']:.0f} leases hold "
                    f"{occupied['devices_held']:.0f} devices "
                    f"({100 * occupied['share_held']:.0f} %) for the whole run",
                    flush=True,
                )
            await load.closed(4, 1.0)  # warm-up: caches, first snapshot, JIT of connections
            pids = {f"{p.name}-{i}": p.process.pid for i, p in enumerate(stack.services)}
            # The servers too: what one grant costs them says when one of them is the limit.
            for name, server in zip(SERVERS, (nats, redis_server), strict=True):
                if server.process is not None:
                    pids[name] = server.process.pid
            services = dict(pids)
            # And this process: the client's own share of the same cores.
            pids["load-generator"] = os.getpid()
            g0 = load.tally.kinds["AllocationGranted"]
            load.granted = []
            profilers = (
                start_profilers(
                    {k: v for k, v in services.items() if k not in SERVERS},
                    args.profile / sc.name,
                    args.profile_format,
                )
                if args.profile
                else []
            )
            counts0 = await asyncio.to_thread(scrape)
            # The floor and the closed loop take turns, in equal slices, so that both see the
            # same machine: on a shared one its speed drifts by tens of percent within minutes.
            usage = Usage(pids, redis, nats)
            floor_steal = StealMeter()
            floor_rates, closed_rates = [], []
            gc_mark = quiet_collector()
            for _ in range(rounds):
                floor_steal.start()
                floor_rates.append(
                    await floor_rate(floor_nc, args.concurrency, args.floor_s / rounds)
                )
                floor_steal.stop()
                await usage.start()
                closed_rates.append(await load.closed(args.concurrency, args.duration_s / rounds))
                await usage.stop()
            counts1 = await asyncio.to_thread(scrape)
            await stop_profilers(profilers, args.profile and args.profile / sc.name)
            grants = load.tally.kinds["AllocationGranted"] - g0
            rss = {k: proc_usage(pid)[1] for k, pid in pids.items()}
            closed_lat = load.latencies
            rate = sum(closed_rates) / rounds
            result["floor"] = fl = {
                "rate_per_s": sum(floor_rates) / rounds,
                "rate_per_s_by_round": floor_rates,
                "serial_p50_ms": 0.0,
                "serial_p99_ms": 0.0,
                # Cores the hypervisor took from this VM meanwhile (the closed loop's beside it).
                "host_steal_cores": floor_steal.cores,
            }
            result["closed"] = {
                "grants_per_s": rate,
                "grants_per_s_by_round": closed_rates,
                "ratio_to_floor": rate / fl["rate_per_s"],
                "ratio_to_floor_by_round": [
                    c / f for c, f in zip(closed_rates, floor_rates, strict=True)
                ],
                "grants": grants,
                "host_steal_cores": usage.steal.cores,
                "p50_ms": 1000 * percentile(closed_lat, 0.5),
                "p99_ms": 1000 * percentile(closed_lat, 0.99),
                "redis_commands_per_grant": usage.commands.total() / max(1, grants),
                "redis_commands_per_grant_by_name": {
                    k: v / max(1, grants) for k, v in usage.commands.most_common(20)
                },
                "nats_in_msgs_per_grant": usage.nats_in / max(1, grants),
                "nats_out_msgs_per_grant": usage.nats_out / max(1, grants),
                # (CPU ms per grant is CPU s per 1,000 grants.)
                "cpu_s_per_1000_grants": usage.cpu_ms_per_job(grants),
                "syscalls_per_grant": usage.syscalls_per_job(grants),
                "rss_mib": {k: rss[k] / 2**20 for k in pids},
                # Scheduling cycles the closed loop caused (one replica's; none while every
                # request is placed on admission).
                **cycle_figures(counts0, counts1),
                # Admission commits that carried the next batch's read (batches under load).
                "carried_reads": counts1.get("read_carried", 0.0)
                - counts0.get("read_carried", 0.0),
                # The scheduler's full passes of the cyclic collector (each a stall of every
                # request in flight), and the load generator's own (floor slices included).
                "full_collections": counts1.get("gc_2", 0.0) - counts0.get("gc_2", 0.0),
                "load_generator_full_collections": full_passes_since(gc_mark),
                **grant_order_figures(counts0, counts1),
            }
            floor_serial_lat: list[float] = []
            if sc.open_loop:
                opened: dict[str, Any] = {}
                views0 = await asyncio.to_thread(scrape)
                if args.serial_costs:
                    await start_slowlog(redis)
                serial_profilers = (
                    start_profilers(
                        {k: v for k, v in services.items() if k not in SERVERS},
                        args.profile / sc.name / "serial",
                        args.profile_format,
                    )
                    if args.profile
                    else []
                )
                # Taking turns with the floor, as the closed loop does.
                usage = Usage(pids, redis, nats)
                serial: list[bool] = []
                lat: list[float] = []
                gc_mark = quiet_collector()
                floor_serial_steal = StealMeter()
                for r in range(rounds):
                    floor_serial_steal.start()
                    floor_serial_lat += await floor_serial(
                        floor_nc, max(1, args.floor_serial_count // rounds)
                    )
                    floor_serial_steal.stop()
                    jobs = args.serial_count // rounds + (r < args.serial_count % rounds)
                    load.granted = []
                    await usage.start()
                    serial += [await load.one() for _ in range(jobs)]
                    await usage.stop()
                    lat += load.latencies
                await stop_profilers(
                    serial_profilers, args.profile and args.profile / sc.name / "serial"
                )
                views1 = await asyncio.to_thread(scrape)
                fl["serial_p50_ms"] = 1000 * percentile(floor_serial_lat, 0.5)
                fl["serial_p99_ms"] = 1000 * percentile(floor_serial_lat, 0.99)
                fl["serial_host_steal_cores"] = floor_serial_steal.cores
                opened["serial"] = {
                    "granted": sum(serial),
                    "p50_ms": 1000 * percentile(lat, 0.5),
                    "p99_ms": 1000 * percentile(lat, 0.99),
                    "p50_ratio_to_floor": 1000 * percentile(lat, 0.5) / fl["serial_p50_ms"],
                    "host_steal_cores": usage.steal.cores,
                    # Placed on the kept copy without a read, and of those refused for a change.
                    **kept_copy_figures(views0, views1),
                    **grant_order_figures(views0, views1),
                    # Each process's CPU per job (its release included): on two cores the
                    # serial loop is CPU-bound, so this is where its time goes.
                    "cpu_ms_per_job": usage.cpu_ms_per_job(len(serial)),
                    "syscalls_per_job": usage.syscalls_per_job(len(serial)),
                    "load_generator_full_collections": full_passes_since(gc_mark),
                }
                if args.serial_costs:
                    opened["serial"]["redis_us_per_job"] = await redis_time_per_job(
                        redis, args.serial_count
                    )
                for pct in (25, 50, 80):
                    usage = Usage(pids, redis, nats)
                    views0 = await asyncio.to_thread(scrape)
                    rewrites0 = (await redis.info("persistence"))["aof_rewrites"]
                    if args.latencies:
                        # Redis's own record of slow events in the phase, a sample per second
                        # that had one: its fsyncs of the AOF (appendfsync always), the
                        # commands and scripts, and the rewrite's fork.
                        await redis.config_set("latency-monitor-threshold", 1)
                        await redis.latency_reset()
                    open_dir = args.profile and args.profile / sc.name / f"open-{pct}"
                    open_profilers = (
                        start_profilers(
                            {k: v for k, v in services.items() if k not in SERVERS},
                            open_dir,
                            args.profile_format,
                        )
                        if open_dir
                        else []
                    )
                    gc_mark = quiet_collector()
                    await usage.start()
                    started, wall_started = time.monotonic(), time.time()
                    arrivals = random.Random(pct) if args.arrivals == "poisson" else None
                    lat = await load.open(rate * pct / 100, args.open_s, arrivals)
                    load_gc = full_passes_since(gc_mark)
                    rewriting = aof_rewrite_windows(
                        redis_server.workdir / "server.log", wall_started, time.time()
                    )
                    granted = load.granted
                    if args.latencies:
                        args.latencies.mkdir(parents=True, exist_ok=True)
                        kinds = [
                            name.decode() if isinstance(name, bytes) else str(name)
                            for name, *_ in await redis.latency_latest()
                        ]
                        redis_events = {
                            kind: [
                                (int(at), int(ms)) for at, ms in await redis.latency_history(kind)
                            ]
                            for kind in kinds
                        }
                        await redis.config_set("latency-monitor-threshold", 0)
                        (args.latencies / f"{sc.name}-open-{pct}.json").write_bytes(
                            json.dumps(
                                {
                                    "granted": granted,
                                    "aof_rewrites": rewriting,
                                    "redis_latency_events": redis_events,
                                }
                            ).encode()
                        )
                    await usage.stop()
                    await stop_profilers(open_profilers, open_dir)
                    elapsed = time.monotonic() - started
                    views1 = await asyncio.to_thread(scrape)
                    rewrites1 = (await redis.info("persistence"))["aof_rewrites"]
                    opened[f"{pct}%"] = {
                        "rate_per_s": rate * pct / 100,
                        "arrivals": args.arrivals,
                        "granted": len(lat),
                        "p50_ms": 1000 * percentile(lat, 0.5),
                        "p99_ms": 1000 * percentile(lat, 0.99),
                        "p999_ms": 1000 * percentile(lat, 0.999),
                        # How close to the machine's cores the rate ran it, and who spent what
                        # per job: at a lower rate batches are smaller and a job costs more.
                        "cores_busy": sum(usage.cpu_s.values()) / elapsed,
                        "host_steal_cores": usage.steal.cores,
                        **kept_copy_figures(views0, views1),
                        **cycle_figures(views0, views1),
                        **grant_order_figures(views0, views1),
                        # Each AOF rewrite forks and its child takes a core for a second or
                        # so at this ledger size: the open loop's tail follows them.
                        "aof_rewrites": rewrites1 - rewrites0,
                        # An AOF rewrite's child shares the machine's two cores for about a
                        # second: the jobs that overlapped none, apart (their p99 beside the
                        # phase's, which counts every job).
                        "aof_rewrite_s": sum(b - a for a, b in rewriting),
                        "jobs_during_aof_rewrites": len(lat)
                        - len(outside_rewrites(granted, rewriting)),
                        "p99_ms_outside_aof_rewrites": p99_ms_outside_rewrites(
                            granted, rewriting, rewrites1 - rewrites0
                        ),
                        "load_generator_full_collections": load_gc,
                        "cpu_ms_per_job": usage.cpu_ms_per_job(len(lat)),
                        "syscalls_per_job": usage.syscalls_per_job(len(lat)),
                        # Calls per job by command, those inside scripts included: small
                        # batches pay per batch what the closed loop shares.
                        "redis_commands_per_job_by_name": {
                            k: v / max(1, len(lat)) for k, v in usage.commands.most_common()
                        },
                    }
                result["open"] = opened
            else:
                floor_serial_lat = await floor_serial(floor_nc, args.floor_serial_count)
                fl["serial_p50_ms"] = 1000 * percentile(floor_serial_lat, 0.5)
                fl["serial_p99_ms"] = 1000 * percentile(floor_serial_lat, 0.99)
            await asyncio.sleep(1.0)  # late duplicates would arrive here
            problems = load.tally.problems()
            problems += await audit(ledger)
            result["submitted"] = len(load.tally.submitted)
            result["outcomes"] = dict(load.tally.kinds)
            result["problems"] = problems
            dead = [p.name for p in stack.services if not p.alive()]
            if dead:
                problems.append(f"services died: {dead}")
    finally:
        if floor_nc is not None:
            await floor_nc.close()
        await redis.aclose()
        stack.stop()
        responder.kill()
        responder.wait()
        nats.stop()
        redis_server.stop()
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'scenario':<14}{'devices':>8}{'floor/s':>9}{'grants/s':>10}{'ratio':>7}"
        f"{'p50 ms':>8}{'p99 ms':>8}{'redis/g':>8}{'nats/g':>8}  cpu s/1000 grants",
    ]
    for r in results:
        c = r["closed"]
        cpu = ", ".join(f"{k}={v:.1f}" for k, v in c["cpu_s_per_1000_grants"].items())
        lines.append(
            f"{r['scenario']:<14}{r['devices_registered']:>8}{r['floor']['rate_per_s']:>9.0f}"
            f"{c['grants_per_s']:>10.1f}{c['ratio_to_floor']:>7.3f}{c['p50_ms']:>8.1f}"
            f"{c['p99_ms']:>8.1f}{c['redis_commands_per_grant']:>8.1f}"
            f"{c['nats_in_msgs_per_grant'] + c['nats_out_msgs_per_grant']:>8.1f}  {cpu}"
        )
        refused = {k: v for k, v in r["outcomes"].items() if k != "AllocationGranted"}
        if refused:
            lines.append(f"  outcomes other than a grant: {refused}")
        if r["replicas"] == 1:
            mean = f" ({cycle_time(c)} on average)" if c["cycles"] else ""
            lines.append(
                f"  closed loop: {c['cycles']:.0f} scheduling cycles{mean},"
                f" {c['carried_reads']:.0f} admission batches carrying a read,"
                f" {c['full_collections']:.0f} full collections"
                f" (the load generator's {c['load_generator_full_collections']:.0f})"
                + stolen(c.get("host_steal_cores"), r["floor"].get("host_steal_cores"))
            )
        elif note := stolen(c.get("host_steal_cores"), r["floor"].get("host_steal_cores")):
            lines.append(f"  closed loop: {note.removeprefix('; ')}")
        lines.append(f"  closed loop: {grant_order(c)}")
        for k, v in r.get("open", {}).items():
            name = f"{k} {v['arrivals']}" if v.get("arrivals") == "poisson" else k
            lines.append(
                f"  open {name:<8} p50 {v['p50_ms']:.1f} ms  p99 {v['p99_ms']:.1f} ms"
                + (f"  p99.9 {v['p999_ms']:.1f} ms" if "p999_ms" in v else "")
                + f"  (floor serial p50 {r['floor']['serial_p50_ms']:.2f} ms)"
                + (
                    f"  kept copy {v['decided_on_kept_copy']:.0f}/{v['granted']}"
                    f" ({v['view_changed']:.0f} changed)"
                    f"  batches on a carried read {v.get('decided_on_carried_read', 0):.0f}"
                    if "decided_on_kept_copy" in v
                    else ""
                )
                + (f"  cycles {v['cycles']:.0f} ({cycle_time(v)})" if v.get("cycles") else "")
                + (f"  AOF rewrites {v['aof_rewrites']}" if "aof_rewrites" in v else "")
                + f"  load generator's full collections {v['load_generator_full_collections']}"
            )
            if v.get("aof_rewrite_s") and v.get("p99_ms_outside_aof_rewrites") is not None:
                lines.append(
                    f"    {v['jobs_during_aof_rewrites']} jobs overlapped"
                    f" {v['aof_rewrite_s']:.2f} s of AOF rewrite; the other jobs' p99"
                    f" {v['p99_ms_outside_aof_rewrites']:.1f} ms"
                )
            if "cpu_ms_per_job" in v:
                per_job = ", ".join(f"{n}={ms:.2f}" for n, ms in v["cpu_ms_per_job"].items())
                busy = f" ({v['cores_busy']:.2f} cores busy)" if "cores_busy" in v else ""
                floor = r["floor"].get("serial_host_steal_cores") if k == "serial" else None
                lines.append(
                    f"    CPU ms per job{busy}: {per_job}"
                    + stolen(v.get("host_steal_cores"), floor)
                )
            if "grant_waits" in v:
                lines.append(f"    {grant_order(v)}")
            if "syscalls_per_job" in v:
                calls = ", ".join(
                    f"{n}={c['read']:.1f}/{c['write']:.1f}"
                    for n, c in v["syscalls_per_job"].items()
                )
                lines.append(f"    read/write syscalls per job: {calls}")
            for name, cost in v.get("redis_us_per_job", {}).items():
                lines.append(
                    f"    redis {name:<28} {cost['calls']:6.2f} calls/job"
                    f" {cost['us_per_call']:8.1f} us/call {cost['us']:8.1f} us/job"
                )
        for p in r["problems"]:
            lines.append(f"  PROBLEM: {p}")
    return "\n".join(lines)


def grant_order(figures: Mapping[str, Any]) -> str:
    """The table's note of what keeping a lease's later events after its grant cost."""
    return (
        f"later events that waited for their grant {figures.get('grant_waits', 0.0):.0f},"
        f" went after a copy of it {figures.get('grant_copies', 0.0):.0f}"
    )


def stolen(cores: float | None, floor_cores: float | None = None) -> str:
    """The table's note of cores the hypervisor took meanwhile (``host_steal_s``), when it took
    any: the ratios of such a slice say as much about the neighbours as about the stack."""
    if not cores and not floor_cores:
        return ""
    floor = f" (in the floor's slices {floor_cores:.2f})" if floor_cores is not None else ""
    return f"; the host took {cores or 0.0:.2f} of the cores{floor}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small fleet, short")
    parser.add_argument(
        "--devices", type=int, default=None, help="one scenario of this many devices instead"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--open-s", type=float, default=10.0)
    parser.add_argument(
        "--arrivals",
        choices=["constant", "poisson"],
        default="constant",
        help="the open loop's arrivals: evenly spaced (the issue's generator), or Poisson",
    )
    parser.add_argument(
        "--submit",
        choices=["request", "stream"],
        default="request",
        help="how the load generator submits: by request/reply (jobs.submit, the client's "
        "submit_and_wait) or published on the job stream (jobs.requested) and waited for",
    )
    parser.add_argument(
        "--serial-count",
        type=int,
        default=400,
        help="serial jobs (with 50, the default until 2026-12, their p50's ratio to the "
        "floor's moved by up to a sixth between runs of the same code)",
    )
    parser.add_argument(
        "--floor-serial-count", type=int, default=500, help="the serial floor's round trips"
    )
    parser.add_argument(
        "--floor-s", type=float, default=4.0, help="seconds of the floor at full concurrency"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="turns the floor and the measured loops take (closed loop and serial run)",
    )
    parser.add_argument(
        "--workload",
        choices=["synthetic", "trace"],
        default="synthetic",
        help="synthetic: the fleets of --devices (or the three default scenarios) and a mix of "
        "shares, whole devices and gangs; trace: one scenario on the Alibaba GPU trace's nodes "
        "and pods (trace_workload)",
    )
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument(
        "--fleet-busy-share",
        type=float,
        default=0.0,
        help="share of each node's devices reporting a moving utilisation every heartbeat",
    )
    parser.add_argument(
        "--occupied",
        type=float,
        default=0.0,
        help="share of the fleet's devices held by leases that outlive the run (a busy pool)",
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy profiles to DIR")
    parser.add_argument(
        "--latencies",
        type=Path,
        default=None,
        help="each open phase's jobs to DIR/<scenario>-open-<percent>.json: submit (wall clock) "
        "and seconds to the grant, with the phase's AOF rewrites and Redis's latency events "
        "(bench/e2e/timeline.py DIR prints them second by second)",
    )
    parser.add_argument(
        "--serial-costs",
        action="store_true",
        help="Redis's time per serial job, by command and ledger script (SLOWLOG)",
    )
    parser.add_argument(
        "--profile-format", default="flamegraph", choices=("flamegraph", "speedscope", "raw")
    )
    args = parser.parse_args(argv)
    trace = args.workload == "trace"
    if trace:
        scenarios = [Scenario("trace-openb", 0, open_loop=True, trace=True)]
    elif args.devices is not None:
        scenarios = [Scenario(f"fleet-{args.devices}", args.devices, open_loop=True)]
    if args.quick:
        if not trace:
            scenarios = [Scenario("quick", args.devices or 64, open_loop=True)]
        # The smoke run's lengths, unless given on the command line.
        quick = {
            "duration_s": 4.0,
            "open_s": 3.0,
            "serial_count": 10,
            "floor_serial_count": 100,
            "floor_s": 1.0,
        }
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    elif args.devices is None and not trace:
        scenarios = [
            Scenario("fleet-10k", 10_000, open_loop=True),
            Scenario("fleet-1k", 1_000),
            Scenario("2-replicas", 10_000, replicas=2),
        ]
    work = Path(tempfile.mkdtemp(prefix="xpupool-bench-e2e-"))
    # On uvloop, as the services and the floor's responder run.
    results = [uvloop.run(run_scenario(sc, args, work)) for sc in scenarios]
    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = args.out or Path(__file__).parent / "results" / f"e2e-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"contended": True, "results": results}, indent=2))
    print(table(results))
    print(f"JSON: {out}")
    failed = [r["scenario"] for r in results if r["problems"]]
    if failed:
        print(f"FAILED correctness checks: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
