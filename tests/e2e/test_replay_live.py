"""``xpupool replay --live`` on a reduced trace: the services place exactly as the replay does."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpupool.devstack.servers import NatsServer, RedisServer
from xpupool.replay.live import replay_live
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

TRACE = find_trace_dir(Path(__file__).resolve())
#: Every 40th node of the trace's 1,213 (31 nodes, every GPU model) and its first 300 pods.
NODE_STEP = 40
PODS = 300
SEED = 42


@pytest.mark.skipif(TRACE is None, reason="the Alibaba trace is not beside the repository")
@pytest.mark.parametrize("policy", ["xpupool-online", "fgd"])  # the scheduler default; FGD
async def test_live_replay_places_exactly_as_the_in_process_replay(
    policy: str, nats_server: NatsServer, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Same seed, same policy: every pod, CPU-only ones (host-only requests) included, lands on
    the same node and GPUs (or is dropped) live as in process, so the allocation ratios are
    equal; nothing is left pending."""
    assert TRACE is not None
    nodes = load_nodes(TRACE / "openb_node_list_gpu_node.csv")[::NODE_STEP]
    pods = load_pods(TRACE / "openb_pod_list_default.csv")[:PODS]
    result = await replay_live(
        nodes,
        pods,
        policy,
        SEED,
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        workdir=tmp_path / "replay",
        heartbeat_s=2.0,
    )
    assert result.first_divergence is None
    assert result.live.alloc_at(100) == result.inprocess.alloc_at(100)
    assert result.live.final_alloc_pct == result.inprocess.final_alloc_pct
    assert result.granted > 0 and result.withdrawn > 0
    assert result.cpu_only > 0 and result.submitted == result.inprocess.pods
    assert len(result.grant_ms) == result.granted
