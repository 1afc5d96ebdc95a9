"""The ``xpupool`` command line: submit and manage jobs, inspect the pool, run a dev stack."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, TypedDict
from urllib.parse import urlsplit, urlunsplit

import msgspec
import nats.errors

from xpupool.cli import usage as usage_cli
from xpupool.client import connected
from xpupool.contracts import DeviceDemand, DeviceSelector, HostDemand, JobRequested, Vendor
from xpupool.runner import EXIT_LEASE_LOST, EXIT_NOT_GRANTED, RunOptions, parse_size_mib, run_job

if TYPE_CHECKING:
    # Imported by the commands that use them: `xpupool run`, `submit` and the other NATS
    # commands start without Redis's client, the ledger, numpy or the dev stack (a third of
    # the command's start).
    from redis.asyncio import Redis

    from xpupool.devstack.stack import NodeSpec

DEFAULT_NATS = "nats://127.0.0.1:4222"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _urls(args: argparse.Namespace) -> tuple[str, str, str]:
    return (
        args.nats_url or os.environ.get("XPUPOOL_NATS_URL", DEFAULT_NATS),
        args.redis_url or os.environ.get("XPUPOOL_REDIS_URL", DEFAULT_REDIS),
        os.environ.get("XPUPOOL_NAMESPACE", "xpupool"),
    )


class _NatsSecurity(TypedDict):
    """``connected``'s security keywords."""

    creds: str | None
    tls_ca: str | None


def _nats_security(args: argparse.Namespace) -> _NatsSecurity:
    """The credentials file and CA for the NATS connection (options, else environment)."""
    return {
        "creds": args.creds or os.environ.get("XPUPOOL_NATS_CREDS") or None,
        "tls_ca": args.tls_ca or os.environ.get("XPUPOOL_NATS_TLS_CA") or None,
    }


def _redis_client(args: argparse.Namespace, url: str) -> Redis:
    """A Redis client; a rediss:// URL is verified with --redis-tls-ca / $XPUPOOL_REDIS_TLS_CA."""
    from redis.asyncio import Redis

    ca = args.redis_tls_ca or os.environ.get("XPUPOOL_REDIS_TLS_CA")
    return Redis.from_url(url, ssl_ca_certs=ca) if ca else Redis.from_url(url)


def _print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


async def _submit(args: argparse.Namespace) -> int:
    nats_url, _, _ = _urls(args)
    request = JobRequested(
        job_id=args.job_id or f"job-{uuid.uuid4().hex[:12]}",
        tenant=args.tenant,
        count=args.count,
        device=DeviceDemand(
            memory_mib=args.memory_mib, memory_pct=args.memory_pct, compute_pct=args.compute_pct
        ),
        selector=DeviceSelector(
            vendor=Vendor(args.vendor) if args.vendor else None, models=args.model or []
        ),
        host=HostDemand(cpu_milli=args.cpu_milli, memory_mib=args.host_memory_mib),
        lease_ttl_s=args.ttl,
        priority=args.priority,
        queue=args.queue,
    )
    async with connected(nats_url, args.tenant, **_nats_security(args)) as client:
        if not args.wait:
            await client.submit(request)
            _print_json({"job_id": request.job_id, "submitted": True})
            return 0
        try:
            outcome = await client.submit_and_wait(request, timeout_s=args.timeout)
        except TimeoutError:
            sys.stderr.write(
                f"no outcome for {request.job_id} within {args.timeout}s "
                f"(see `xpupool explain {request.job_id}`)\n"
            )
            return 2
        _print_json(outcome)
        return 0 if type(outcome).__name__ == "AllocationGranted" else 1


def _tenant(args: argparse.Namespace) -> str:
    tenant: str | None = args.tenant or os.environ.get("XPUPOOL_TENANT")
    if not tenant:
        raise UsageError(f"xpupool {args.command} needs a tenant: --tenant NAME or $XPUPOOL_TENANT")
    return tenant


async def _jobs(args: argparse.Namespace) -> int:
    tenant = _tenant(args)
    nats_url, _, _ = _urls(args)
    async with connected(nats_url, tenant, **_nats_security(args)) as client:
        listed = await client.jobs(args.limit)
    if args.json or not listed.ok:
        _print_json(listed)
        return 0 if listed.ok else 1
    for job in listed.jobs:
        since = job.since.strftime("%Y-%m-%d %H:%M:%S") if job.since else "-"
        why = job.reason.value if job.reason else ""
        print(f"{job.job_id:<40} {job.state.value:<10} {since}  {job.lease_id or ''} {why}")
    return 0


async def _leases(args: argparse.Namespace) -> int:
    tenant = _tenant(args)
    nats_url, _, _ = _urls(args)
    async with connected(nats_url, tenant, **_nats_security(args)) as client:
        listed = await (client.lease(args.lease_id) if args.lease_id else client.leases(args.limit))
    if args.json or not listed.ok:
        _print_json(listed)
        return 0 if listed.ok else 1
    for lease in listed.leases:
        where = ", ".join(f"{x.node_id}/{x.device_id}" for x in lease.slices) or "host only"
        until = lease.expires_at.strftime("%H:%M:%S") if lease.expires_at else "-"
        print(f"{lease.lease_id:<44} {lease.job_id:<32} {lease.state.value:<8} {until}  {where}")
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    tenant = _tenant(args)
    nats_url, _, _ = _urls(args)
    async with connected(nats_url, tenant, **_nats_security(args)) as client:
        reply = await client.cancel(args.job_id)
    _print_json(reply)
    return 0 if reply.ok else 1


async def _lease_command(args: argparse.Namespace) -> int:
    nats_url, _, _ = _urls(args)
    secret = args.secret or os.environ.get("XPUPOOL_LEASE_SECRET", "")
    if not secret:
        sys.stderr.write("the lease secret is needed: --secret or $XPUPOOL_LEASE_SECRET\n")
        return 2
    async with connected(nats_url, args.tenant, **_nats_security(args)) as client:
        if args.command == "release":
            reply = await client.release(args.lease_id, args.token, secret=secret)
        else:
            reply = await client.renew(args.lease_id, args.token, args.ttl, secret=secret)
    _print_json(reply)
    return 0 if reply.ok else 1


async def _status(args: argparse.Namespace) -> int:
    from xpupool.ledger import Ledger

    _, redis_url, namespace = _urls(args)
    redis = _redis_client(args, redis_url)
    if not args.nodes:
        from xpupool.cli import console

        try:
            summary = await console.read_summary(Ledger(redis, namespace))
        finally:
            await redis.aclose()
        console.print_summary(summary, args.json)
        return 0
    try:
        nodes = await Ledger(redis, namespace).nodes()
    finally:
        await redis.aclose()
    if args.json:
        _print_json(
            [
                {
                    "node_id": n.node_id,
                    "status": n.status,
                    "devices": [
                        {
                            "device_id": d.spec.device_id,
                            "model": d.spec.model,
                            "vendor": d.spec.vendor,
                            "health": d.health,
                            "memory_total_mib": d.memory_total_mib,
                            "memory_free_mib": d.memory_free_mib,
                            "compute_free_pct": d.compute_free_pct,
                            "holders": d.holders,
                        }
                        for d in n.devices
                    ],
                }
                for n in nodes
            ]
        )
        return 0
    if not nodes:
        print("no nodes registered")
    for n in nodes:
        print(f"{n.node_id}  {n.status}  cpu {n.cpu_free_milli}/{n.cpu_total_milli} milli free")
        for d in n.devices:
            used = 1 - d.memory_free_mib / d.memory_total_mib if d.memory_total_mib else 0
            bar = "#" * round(used * 20)
            print(
                f"  {d.spec.device_id:<24} {d.spec.model:<18} {d.health.value:<9} "
                f"[{bar:<20}] {used:5.0%} mem used, {100 - d.compute_free_pct:3d}% compute, "
                f"{d.holders} holder(s)"
            )
    return 0


async def _usage(args: argparse.Namespace) -> int:
    _, redis_url, namespace = _urls(args)
    redis = _redis_client(args, redis_url)
    try:
        return await usage_cli.run(args, redis, namespace)
    finally:
        await redis.aclose()


async def _explain(args: argparse.Namespace) -> int:
    from xpupool.ledger import Ledger

    _, redis_url, namespace = _urls(args)
    redis = _redis_client(args, redis_url)
    try:
        ledger = Ledger(redis, namespace)
        job = await ledger.get_job(args.job_id)
        lease = await ledger.get_lease(job.lease_id) if job and job.lease_id else None
    finally:
        await redis.aclose()
    if job is None:
        print(f"{args.job_id}: unknown to the ledger (never accepted, rejected, or long gone)")
        return 1
    result: dict[str, object] = {"job_id": job.job_id, "state": job.state}
    if job.state == "pending":
        result.update(reason=job.reason, detail=job.detail)
    if lease is not None:
        result.update(
            lease_id=lease.lease_id,
            lease_state=lease.state,
            devices=[s.device_id for s in lease.slices],
            host={
                n: {"cpu_milli": h.cpu_milli, "memory_mib": h.memory_mib}
                for n, h in lease.host.items()
            },
        )
        if lease.end_reason:
            result.update(end_reason=lease.end_reason, end_detail=lease.end_detail)
    _print_json(result)
    return 0


async def _scale_status(args: argparse.Namespace) -> int:
    """``xpupool scale status``: the acting autoscaler's last snapshot, read from the ledger."""
    from xpupool.autoscaler.status import decode_status, render
    from xpupool.ledger import Ledger

    _, redis_url, namespace = _urls(args)
    redis = _redis_client(args, redis_url)
    try:
        ledger = Ledger(redis, namespace)
        raw = await redis.get(ledger.key("autoscaler", "status"))
        now = await ledger.now_ms() / 1000
    finally:
        await redis.aclose()
    if raw is None:
        print(
            f"no autoscaler status in namespace {namespace!r} at {_redacted(redis_url)}: "
            "no autoscaler has acted there yet (is one running, with a pool file?)",
            file=sys.stderr,
        )
        return 1
    try:
        status = decode_status(raw if isinstance(raw, bytes) else raw.encode())
    except msgspec.DecodeError as error:
        print(f"the autoscaler status does not decode: {error}", file=sys.stderr)
        return 1
    if args.json:
        _print_json(status)
    else:
        print(render(status, now))
    return 0


def _add_console(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser("top", help="the pool and queues, live, with the latest events")
    top.add_argument("--interval", type=_positive, default=2.0, help="seconds between refreshes")
    top.add_argument("--iterations", type=int, default=0, help="frames to draw (0: until Ctrl-C)")
    top.add_argument("--once", action="store_true", help="draw one frame and exit")
    events = sub.add_parser("events", help="pool events: grants, preemptions, health, scaling")
    events.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    events.add_argument("--tenant", help="only this tenant's (with its credentials: its own)")
    events.add_argument(
        "--type", action="append", default=[], help="e.g. granted, alloc, health (repeatable)"
    )
    events.add_argument(
        "--limit", type=_positive_int, default=50, help="recent events without --follow"
    )
    events.add_argument("--json", action="store_true", help="JSON lines (also when not a tty)")


def _fleet(text: str | None) -> list[NodeSpec]:
    """``--fleet``: one simulated node per comma-separated profile (``+`` joins models on one
    node: ``2xT4+1xMLU370-X4``), each checked against the catalog; None: the demo's fleet."""
    from xpupool.devices import load_catalog
    from xpupool.devices.simulated import SimulatedBackend
    from xpupool.devstack.demo import DEFAULT_FLEET
    from xpupool.devstack.stack import NodeSpec

    if text is None:
        return list(DEFAULT_FLEET)
    profiles = [item.strip().replace("+", ",") for item in text.split(",") if item.strip()]
    if not profiles:
        raise UsageError("--fleet names no node; e.g. --fleet 2xA100-80GB,4xAscend910B")
    catalog = load_catalog()
    nodes = []
    for index, profile in enumerate(profiles):
        node_id = f"node-{chr(ord('a') + index)}" if index < 26 else f"node-{index + 1}"
        SimulatedBackend(node_id, profile, catalog).close()  # ProfileError if it cannot be
        nodes.append(NodeSpec(node_id, profile))
    return nodes


def _queue_config(path: str) -> str:
    """``--queues``: the scheduler's queue file, checked as the scheduler will (its built-in and
    trace policies), as an absolute path."""
    from xpupool.placement.node_policies import make_trace_policies
    from xpupool.scheduler.domain import load_config
    from xpupool.scheduler.domain.config import BUILTIN_POLICIES

    known = (*BUILTIN_POLICIES, *(p.name for p in make_trace_policies()))
    load_config(path, known_policies=known)
    return str(Path(path).resolve())


def _dev_up(args: argparse.Namespace) -> int:
    from xpupool.devstack.stack import Stack

    if args.schedulers < 1:
        raise UsageError("--schedulers must be at least 1")
    nodes = _fleet(args.fleet)
    options: dict[str, object] = {"schedulers": args.schedulers}
    if args.queues:
        options["extra_env"] = {"XPUPOOL_QUEUE_CONFIG": _queue_config(args.queues)}
    if args.pools:
        from xpupool.autoscaler.pools import PoolConfigError, load_pools

        try:
            load_pools(args.pools)
        except PoolConfigError as error:
            raise UsageError(str(error)) from None
        options.update(
            autoscalers=max(1, args.autoscalers), pools_file=str(Path(args.pools).resolve())
        )
    elif args.autoscalers:
        raise UsageError("--autoscalers needs --pools FILE")
    if args.dir:
        options["workdir"] = Path(args.dir)
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.secure:
        # Its own secured servers: no external URL applies.
        options.update(secure=True, tenants=[t for t in args.tenants.split(",") if t])
    else:
        options.update(
            nats_url=os.environ.get("XPUPOOL_NATS_URL"),
            redis_url=os.environ.get("XPUPOOL_REDIS_URL"),
        )
    stack = Stack(nodes=nodes, **options)  # type: ignore[arg-type]
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start()
        assert stack.nats_url
        try:
            asyncio.run(stack.wait_until_pulling())
        except TimeoutError as error:
            print(f"the stack did not become ready ({error}); logs in {stack.workdir}")
            return 1
        if stack.material is not None:
            material = stack.material
            print(f"secured (TLS, NKeys, Redis ACL); material in {material.directory}\n")
            for tenant in material.tenants:
                print(material.describe_tenant(tenant))
            print("operator (every right; the CLI's status and explain need its Redis user):")
            for key, value in material.operator_env().items():
                print(f"  export {key}={value}")
        else:
            print(f"XPUPOOL_NATS_URL={stack.nats_url}")
            print(f"XPUPOOL_REDIS_URL={stack.redis_url}")
        print(f"logs in {stack.workdir}; Ctrl-C stops everything", flush=True)
        while not stop:
            signal.pause()
    finally:
        stack.stop()
    return 0


def _delegate(command: str, argv: Sequence[str]) -> int:
    # Imported here, not at the top: the other commands need neither numpy nor the services.
    if command == "devices":
        from xpupool.devices.cli import main as devices_main

        return devices_main(list(argv))
    from xpupool.replay.cli import main as replay_main

    return replay_main(list(argv))


def _finite(text: str) -> float:
    """A number option: ``nan`` and ``inf``, which ``float()`` takes, are refused here rather
    than sent (JSON would carry them as "not given") or worked with."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _positive(text: str) -> float:
    """A number option above 0: ``top --interval 0`` would redraw (reading the whole ledger)
    without a pause."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _positive_int(text: str) -> int:
    """A count option of 1 or more: ``events --limit 0`` would slice ``[-0:]``, every event."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size_mib(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="run a command on a lease: submit, wait, run with the devices, renew, release",
        description="Submit a job, wait for its grant (showing why it waits), run CMD with the "
        "lease's environment, renew while it runs, release when it exits, exit with its code. "
        f"Exit {EXIT_NOT_GRANTED}: rejected or timed out; {EXIT_LEASE_LOST}: the lease ended "
        "under CMD (it got SIGTERM, then SIGKILL after --grace).",
        usage="xpupool run [options] -- CMD [ARGS...]",
    )
    run.add_argument("--tenant", help="the tenant to run as (default $XPUPOOL_TENANT)")
    size = run.add_mutually_exclusive_group()
    size.add_argument("--gpus", type=int, help="whole devices (default 1; 0: host only)")
    size.add_argument(
        "--share", type=_finite, help="a fraction of one device, memory and compute (0.25)"
    )
    run.add_argument("--memory", type=_size, help="device memory per device (20GiB, 512MiB)")
    run.add_argument("--compute", type=int, help="compute share per device, in percent")
    run.add_argument("--vendor", choices=[v.value for v in Vendor])
    run.add_argument("--model", action="append", help="an acceptable model (repeatable)")
    run.add_argument("--queue")
    run.add_argument("--priority", default="normal")
    run.add_argument("--max-wait", type=_finite, help="give up after waiting this many seconds")
    run.add_argument("--cpus", type=_finite, default=0.0, help="host CPUs on the node")
    run.add_argument("--host-memory", type=_size, help="host memory on the node (8GiB)")
    run.add_argument("--ttl", type=_finite, default=60.0, help="lease term, renewed while CMD runs")
    run.add_argument("--grace", type=_finite, default=10.0, help="SIGTERM to SIGKILL, seconds")
    run.add_argument("--job-id")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")


def _run_request(args: argparse.Namespace, tenant: str) -> JobRequested:
    share = None if args.share is None else round(args.share * 100)
    return JobRequested(
        job_id=args.job_id or f"run-{uuid.uuid4().hex[:12]}",
        tenant=tenant,
        count=1 if args.gpus is None else args.gpus,
        device=DeviceDemand(
            memory_mib=args.memory,
            memory_pct=share if args.memory is None else None,
            compute_pct=args.compute if args.compute is not None else share,
        ),
        selector=DeviceSelector(
            vendor=Vendor(args.vendor) if args.vendor else None, models=args.model or []
        ),
        host=HostDemand(cpu_milli=round(args.cpus * 1000), memory_mib=args.host_memory or 0),
        lease_ttl_s=args.ttl,
        priority=args.priority,
        queue=args.queue,
        max_wait_s=args.max_wait,
    )


async def _run_job(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("xpupool run needs a command: xpupool run [options] -- CMD [ARGS...]")
    tenant = args.tenant or os.environ.get("XPUPOOL_TENANT")
    if not tenant:
        raise UsageError("xpupool run needs a tenant: --tenant NAME or $XPUPOOL_TENANT")
    if args.share is not None and not 0 < args.share <= 1:
        raise UsageError(f"--share is a fraction of one device in (0, 1], not {args.share}")
    try:
        request = _run_request(args, tenant)
    except msgspec.ValidationError as error:
        raise UsageError(f"invalid request: {error}") from None
    nats_url, _, _ = _urls(args)
    # Reconnecting for as long as the run lasts: renewals, the lease's end and the release all
    # need the connection, and one that gave up over a NATS restart left CMD running unrenewed.
    security = _nats_security(args)
    async with connected(nats_url, tenant, **security, max_reconnect_attempts=-1) as client:
        return await run_job(client, request, argv, RunOptions(grace_s=args.grace))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and docs)."""
    parser = argparse.ArgumentParser(prog="xpupool", description=__doc__)
    parser.add_argument("--nats-url", help=f"default $XPUPOOL_NATS_URL or {DEFAULT_NATS}")
    parser.add_argument("--redis-url", help=f"default $XPUPOOL_REDIS_URL or {DEFAULT_REDIS}")
    parser.add_argument(
        "--creds", help="NATS credentials: NKey seed or JWT .creds file ($XPUPOOL_NATS_CREDS)"
    )
    parser.add_argument("--tls-ca", help="CA of a tls:// NATS server ($XPUPOOL_NATS_TLS_CA)")
    parser.add_argument(
        "--redis-tls-ca", help="CA of a rediss:// Redis server ($XPUPOOL_REDIS_TLS_CA)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    submit = sub.add_parser("submit", help="publish a job request")
    submit.add_argument("--tenant", required=True)
    submit.add_argument("--job-id")
    submit.add_argument(
        "--count", type=int, default=1, help="devices; 0: a host-only job (give --cpu-milli)"
    )
    submit.add_argument("--memory-mib", type=int)
    submit.add_argument("--memory-pct", type=int)
    submit.add_argument("--compute-pct", type=int)
    submit.add_argument("--vendor", choices=[v.value for v in Vendor])
    submit.add_argument("--model", action="append")
    submit.add_argument("--cpu-milli", type=int, default=0, help="host CPU on the node")
    submit.add_argument("--host-memory-mib", type=int, default=0, help="host memory on the node")
    submit.add_argument("--ttl", type=_finite, default=300.0, help="lease term in seconds")
    submit.add_argument("--priority", default="normal")
    submit.add_argument("--queue")
    submit.add_argument("--wait", action="store_true", help="wait and print the outcome as JSON")
    submit.add_argument("--timeout", type=_finite, default=60.0)

    for name in ("release", "renew"):
        cmd = sub.add_parser(name, help=f"{name} a lease")
        cmd.add_argument("lease_id")
        cmd.add_argument("--token", type=int, required=True, help="the lease's fencing token")
        cmd.add_argument("--tenant", required=True, help="the tenant that holds the lease")
        cmd.add_argument(
            "--secret", help="the grant's lease_secret ($XPUPOOL_LEASE_SECRET; keeps it off ps)"
        )
        if name == "renew":
            cmd.add_argument("--ttl", type=_finite)

    _add_run(sub)
    cancel = sub.add_parser(
        "cancel", help="cancel a job: a waiting one ends, a granted one's lease is released"
    )
    cancel.add_argument("job_id")
    cancel.add_argument("--tenant", help="the job's tenant (default $XPUPOOL_TENANT)")
    jobs = sub.add_parser("jobs", help="your jobs, newest first: waiting (and why), running, ended")
    jobs.add_argument("--tenant", help="default $XPUPOOL_TENANT")
    jobs.add_argument("--limit", type=int, default=50)
    jobs.add_argument("--json", action="store_true")
    leases = sub.add_parser("leases", help="your live leases (or one, with --id)")
    leases.add_argument("--tenant", help="default $XPUPOOL_TENANT")
    leases.add_argument("--id", dest="lease_id", help="one lease, ended ones too")
    leases.add_argument("--limit", type=int, default=50)
    leases.add_argument("--json", action="store_true")

    status = sub.add_parser(
        "status", help="the pool by vendor and model, and per queue (--nodes: devices per node)"
    )
    status.add_argument("--json", action="store_true", help="JSON (also when not a terminal)")
    status.add_argument(
        "--nodes", action="store_true", help="devices per node with their free and used share"
    )
    _add_console(sub)
    usage_cli.add_parser(sub)
    explain = sub.add_parser("explain", help="where a job stands and why")
    explain.add_argument("job_id")

    dev = sub.add_parser("dev", help="development stack")
    dev.add_argument("action", choices=["up"])
    dev.add_argument(
        "--secure",
        action="store_true",
        help="TLS, one NKey identity per service and tenant, Redis ACL users (generated)",
    )
    dev.add_argument(
        "--tenants", default="team-0,team-1,team-2", help="tenant identities for --secure"
    )
    dev.add_argument("--dir", help="the stack's folder (default: a new temporary one)")
    dev.add_argument(
        "--fleet",
        metavar="PROFILE[,PROFILE...]",
        help="one simulated node per profile, e.g. 2xA100-80GB,4xAscend910B,2xT4+1xMLU370-X4 "
        "('+' puts several models on one node); default: the demo's fleet",
    )
    dev.add_argument("--schedulers", type=int, default=1, help="scheduler replicas (default 1)")
    dev.add_argument(
        "--queues", metavar="FILE", help="queue configuration for the schedulers (YAML or TOML)"
    )
    dev.add_argument(
        "--pools",
        metavar="FILE",
        help="start the autoscaler with this pool file (YAML or TOML); off without it",
    )
    dev.add_argument(
        "--autoscalers", type=int, default=0, help="autoscaler replicas with --pools (default 1)"
    )
    scale = sub.add_parser("scale", help="the autoscaler")
    scale_sub = scale.add_subparsers(dest="scale_command", required=True)
    scale_status = scale_sub.add_parser(
        "status",
        help="pools, sizes (ready/provisioning/draining), pending demand, nodes coming and "
        "going, cost per hour",
    )
    scale_status.add_argument("--json", action="store_true")
    demo = sub.add_parser("demo", help="run the demo on embedded servers and print a report")
    demo.add_argument(
        "--secure",
        action="store_true",
        help="the secure configuration (TLS, NKeys, Redis ACLs) instead of open loopback servers",
    )
    sub.add_parser("devices", help="list the accelerators on this machine", add_help=False)
    sub.add_parser(
        "replay", help="replay a cluster trace through the placement code", add_help=False
    )
    return parser


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit 2."""


USER_ERROR = 2


def _redacted(url: str) -> str:
    """``url`` without its password (secure Redis URLs carry one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (
        f":{parts.port}" if parts.port else ""
    )
    return urlunsplit(parts._replace(netloc=netloc))


# Errors the user can act on, said as they are, by the module that defines them.
_SAID_AS_IS: Final = (
    ("xpupool.devstack.servers", "ServerUnavailable"),
    ("xpupool.devices.simulated", "ProfileError"),
    ("xpupool.devices.catalog", "CatalogError"),
    ("xpupool.scheduler.domain.config", "ConfigError"),
)
_REDIS_REFUSED: Final = ("AuthenticationError", "NoPermissionError")
_REDIS_UNREACHABLE: Final = ("ConnectionError", "TimeoutError")


def _loaded(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """The error types ``names`` of ``module`` if it was imported: an error cannot be of a type
    whose module never loaded, and importing it here would cost every command its start."""
    loaded = sys.modules.get(module)
    return tuple(getattr(loaded, name) for name in names) if loaded is not None else ()


def _user_error(error: BaseException, args: argparse.Namespace | None) -> str | None:
    """The one line to print for an error the user can act on (an unreachable or refusing
    server, a missing server binary or file, a model the catalog lacks, a bad queue file);
    None for anything else, which is a bug and keeps its traceback."""
    nats_url, redis_url = (_urls(args)[:2]) if args is not None else ("NATS", "Redis")
    said_as_is = tuple(t for module, name in _SAID_AS_IS for t in _loaded(module, name))
    if isinstance(error, (UsageError, *said_as_is)):
        return str(error)
    if isinstance(error, nats.errors.AuthorizationError):
        return f"NATS at {nats_url} refused the credentials: {error}"
    if isinstance(error, nats.errors.Error):
        return f"cannot reach NATS at {nats_url}: {error}"
    if isinstance(error, _loaded("redis.exceptions", *_REDIS_REFUSED)):
        return f"Redis at {_redacted(redis_url)} refused: {error}"
    if isinstance(error, _loaded("redis.exceptions", *_REDIS_UNREACHABLE)):
        return f"cannot reach Redis at {_redacted(redis_url)}: {error}"
    if isinstance(error, OSError):
        if error.filename is not None and error.strerror:
            return f"{error.filename}: {error.strerror}"
        return str(error) or repr(error)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: user errors (see ``_user_error``) print one line on stderr and exit
    2, Ctrl-C exits 130, both without a traceback."""
    # asyncio warns on every TLS connection nats-py closes ("returning true from eof_received()
    # has no effect when using ssl"): noise on the terminal, not a fault.
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    # nats-py logs each failed connection attempt with its traceback; the one line below says it.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        for index, word in enumerate(argv):
            if word in ("devices", "replay"):
                return _delegate(word, argv[index + 1 :])
            if not word.startswith("-"):
                break
        args = build_parser().parse_args(argv)
        return _run(args)
    except KeyboardInterrupt:
        sys.stderr.write("xpupool: interrupted\n")
        return 130
    except Exception as error:
        message = _user_error(error, args)
        if message is None:
            raise
        sys.stderr.write(f"xpupool: error: {' '.join(message.split())}\n")
        return USER_ERROR


def _run(args: argparse.Namespace) -> int:
    match args.command:
        case "submit":
            return asyncio.run(_submit(args))
        case "run":
            return asyncio.run(_run_job(args))
        case "cancel":
            return asyncio.run(_cancel(args))
        case "jobs":
            return asyncio.run(_jobs(args))
        case "leases":
            return asyncio.run(_leases(args))
        case "release" | "renew":
            return asyncio.run(_lease_command(args))
        case "status":
            return asyncio.run(_status(args))
        case "top" | "events":
            from xpupool.cli.console import run_command

            security = _nats_security(args)
            return asyncio.run(
                run_command(args, *_urls(args), creds=security["creds"], tls_ca=security["tls_ca"])
            )
        case "explain":
            return asyncio.run(_explain(args))
        case "usage":
            return asyncio.run(_usage(args))
        case "scale":
            return asyncio.run(_scale_status(args))
        case "dev":
            return _dev_up(args)
        case "demo":
            from xpupool.devstack.demo import run_demo

            return run_demo(secure=args.secure)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
