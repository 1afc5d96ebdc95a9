"""Where one job's submit -> grant time goes, step by step, from the services' own spans.

``python bench/e2e/anatomy.py [--jobs 40]``: the embedded stack (NATS with JetStream, Redis with
AOF ``appendfsync always``, every service its own process, one 8-GPU node) exporting its spans
over OTLP to a receiver in this process (``xpupool.devstack.otlp``). Jobs are submitted one at a
time, each under a root span of its own, and released once granted. For every step of a job's
trace (each service span, each Redis call) the table gives how often it occurs per job and the
median of its start and its duration, in milliseconds after the submit, so the critical path and
its waits read top to bottom. Tracing itself (and the Redis instrumentation it turns on) adds to
every step: read the shape here and the speed in ``bench_e2e.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from opentelemetry import context, propagate
from redis.asyncio import Redis

from xpupool.contracts import AllocationGranted, DeviceDemand, JobRequested
from xpupool.devstack.otlp import Received, exporter_env, serve_receiver
from xpupool.devstack.servers import NatsServer, RedisServer
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger


def step_name(span: Received) -> str:
    """A span's step: Redis calls by command (and script name when the ledger ran one)."""
    if span.attributes.get("db.system") == "redis":
        return f"redis {span.name}"
    return span.name


def summarise(spans: list[Received], submitted_ns: dict[str, int], granted_ms: list[float]) -> str:
    starts: dict[tuple[str, str], list[float]] = defaultdict(list)
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    # A scheduling cycle has a trace of its own that links the jobs it served: its steps count
    # for the job when it served that job alone (as it does when jobs come one at a time).
    cycle_of = {
        s.trace_id: s.links[0] for s in spans if s.name == "schedule cycle" and len(s.links) == 1
    }
    for span in spans:
        job_trace = cycle_of.get(span.trace_id, span.trace_id)
        t0 = submitted_ns.get(job_trace)
        if t0 is None:
            continue
        cycle = "cycle: " if span.trace_id in cycle_of else ""
        key = (span.service, cycle + step_name(span))
        starts[key].append((span.start_ns - t0) / 1e6)
        durations[key].append((span.end_ns - span.start_ns) / 1e6)
    jobs = len(submitted_ns)
    rows = sorted(starts, key=lambda k: statistics.median(starts[k]))
    lines = [
        f"submit -> grant as the client saw it: p50 {statistics.median(granted_ms):.2f} ms "
        f"over {len(granted_ms)} jobs",
        f"{'service':<15}{'step':<52}{'per job':>8}{'start ms':>10}{'took ms':>9}",
    ]
    for key in rows:
        lines.append(
            f"{key[0]:<15}{key[1][:51]:<52}{len(starts[key]) / jobs:>8.1f}"
            f"{statistics.median(starts[key]):>10.2f}{statistics.median(durations[key]):>9.2f}"
        )
    return "\n".join(lines)


async def run(jobs: int, work: Path) -> str:
    nats, redis = NatsServer(work / "nats"), RedisServer(work / "redis")
    nats.start()
    redis.start()
    try:
        async with serve_receiver() as receiver:
            stack = Stack(
                nodes=[NodeSpec("anatomy-a", "8xA100-80GB")],
                nats_url=nats.url,
                redis_url=redis.url,
                workdir=work / "stack",
                extra_env={"XPUPOOL_LOG_LEVEL": "warning", **exporter_env(receiver)},
            )
            stack.workdir.mkdir(parents=True, exist_ok=True)
            stack.start()
            try:
                ledger = Ledger(Redis.from_url(redis.url), stack.namespace)
                deadline = time.monotonic() + 60
                while not await ledger.nodes():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the node did not register:\n{stack.logs()}")
                    await asyncio.sleep(0.2)
                await stack.wait_until_pulling(timeout_s=60)
                submitted: dict[str, int] = {}
                granted_ms: list[float] = []
                async with stack.client() as client:
                    for i in range(jobs + 3):  # the first three warm caches and connections
                        trace_id = secrets.token_hex(16)
                        carrier = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
                        token = context.attach(propagate.extract(carrier))
                        try:
                            t0 = time.time_ns()
                            request = JobRequested(
                                job_id=f"anatomy-{i}",
                                tenant="bench",
                                device=DeviceDemand(memory_mib=1000),
                            )
                            outcome = await client.submit_and_wait(request)
                            elapsed_ms = (time.time_ns() - t0) / 1e6
                            assert isinstance(outcome, AllocationGranted), outcome
                            await client.release(outcome.lease_id, outcome.fencing_token)
                        finally:
                            context.detach(token)
                        if i >= 3:
                            submitted[trace_id] = t0
                            granted_ms.append(elapsed_ms)
                await asyncio.sleep(2.0)  # the batch span processors' last exports
                return summarise(receiver.spans, submitted, granted_ms)
            finally:
                stack.stop()
    finally:
        nats.stop()
        redis.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="xpupool-anatomy-"))
    print(asyncio.run(run(args.jobs, work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
