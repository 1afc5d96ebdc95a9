"""A trace pod as an xpupool job request: the one mapping the live replay, the scheduler's trace
benches and their tests share."""

from __future__ import annotations

from collections.abc import Mapping

from xpupool.contracts import JobRequested
from xpupool.contracts.payloads import (
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    HostDemand,
    Intent,
)
from xpupool.placement.state import MILLI, PodDemand

DEFAULT_TENANT = "replay"


def job_request(
    job_id: str,
    pod: PodDemand,
    model_names: Mapping[str, str] | None = None,
    *,
    tenant: str = DEFAULT_TENANT,
    queue: str | None = None,
    lease_ttl_s: float = 300.0,
) -> JobRequested:
    """The request for a trace pod.

    A whole-GPU pod asks for ``num_gpu`` whole devices on one node; a sharing pod (``gpu_milli``
    < 1000, always a multiple of 10 in the trace) asks for ``gpu_milli / 10`` percent of compute,
    and gets memory in proportion. ``gpu_spec`` models become model selectors, renamed through
    ``model_names`` (trace name -> catalog name; unknown names are sent as they are, so the
    scheduler rejects them just as the in-process replay finds no node for them). A CPU-only pod
    (``num_gpu == 0``) is a host-only request (``count: 0``): its CPU and memory on one node, no
    device and no selector (the replay ignores ``gpu_spec`` for it too).
    """
    host = HostDemand(cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib)
    if pod.is_cpu_only:
        return JobRequested(
            job_id=job_id,
            tenant=tenant,
            queue=queue,
            count=0,
            host=host,
            lease_ttl_s=lease_ttl_s,
        )
    names = model_names or {}
    device = (
        DeviceDemand() if pod.gpu_milli >= MILLI else DeviceDemand(compute_pct=pod.gpu_milli // 10)
    )
    models = sorted({names.get(m, m) for m in pod.allowed_models}) if pod.allowed_models else []
    return JobRequested(
        job_id=job_id,
        tenant=tenant,
        queue=queue,
        count=pod.num_gpu,
        device=device,
        selector=DeviceSelector(models=models),
        host=host,
        gang=GangSpec(same_node=True) if pod.num_gpu > 1 else None,
        lease_ttl_s=lease_ttl_s,
        # The trace's pods state no preference between GPU models beyond gpu_spec.
        intent=Intent.ANY,
    )
