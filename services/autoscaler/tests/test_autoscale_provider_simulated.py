"""The simulated provider at its process boundary: real child processes with the collector's
environment, state shared through the state directory, replays that never double a node."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from autoscale_builders import make_pool

from xpupool.autoscaler.pools import PoolConfig, SimulatedProviderConfig
from xpupool.autoscaler.providers import NodeLifecycle, ProviderError, make_provider
from xpupool.autoscaler.providers.simulated import (
    COLLECTOR_MODULE,
    CollectorLauncher,
    SimulatedNode,
    SimulatedProvider,
)

# Stands in for `python -m xpupool.telemetry_collector`: records its environment, then idles.
FAKE_COLLECTOR = """
import json, os, sys, time
keys = [k for k in os.environ if k.startswith("XPUPOOL_")]
path = os.path.join(sys.argv[1], os.environ["XPUPOOL_NODE_ID"] + ".env.json")
with open(path, "w") as f:
    json.dump({k: os.environ[k] for k in keys}, f)
time.sleep(120)
"""


class FailingSecondLaunch(CollectorLauncher):
    """Starts one node, then fails: a replica that died half-way through an add."""

    def launch(self, node: SimulatedNode) -> int:
        if getattr(self, "launched", 0):
            raise OSError("killed mid-provisioning")
        self.launched = 1
        return super().launch(node)


STARTED: list[CollectorLauncher] = []


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "envs"
    directory.mkdir()
    yield directory
    while STARTED:  # never leave a process behind
        STARTED.pop().stop_all(timeout_s=2)


def launcher(out: Path, cls: type[CollectorLauncher] = CollectorLauncher) -> CollectorLauncher:
    script = out.parent / "fake_collector.py"
    script.write_text(FAKE_COLLECTOR)
    made = cls(
        out.parent / "logs",
        command=[sys.executable, str(script), str(out)],
        base_env={**os.environ, "XPUPOOL_PARENT_PID": "4242", "XPUPOOL_NATS_URL": "nats://n:1"},
    )
    STARTED.append(made)
    return made


def sim_pool(tmp_path: Path) -> PoolConfig:
    provider = {
        "type": "simulated",
        "state_dir": str(tmp_path / "state"),
        "collector_env": {"XPUPOOL_SAMPLE_INTERVAL_S": "0.5"},
    }
    return make_pool(
        "a100",
        node={"model": "A100-SXM4-80GB", "count": 8, "cpu_milli": 96000, "memory_mib": 65536},
        max_size=3,
        provider=provider,
    )


def provider_for(pool: PoolConfig, out: Path, **kw: object) -> SimulatedProvider:
    assert isinstance(pool.provider, SimulatedProviderConfig)
    made = make_provider(pool.provider, launcher=launcher(out, **kw))  # type: ignore[arg-type]
    assert isinstance(made, SimulatedProvider)
    return made


def wait_for(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


async def test_nodes_are_collectors_with_the_dev_stack_environment(
    tmp_path: Path, out: Path
) -> None:
    pool = sim_pool(tmp_path)
    provider = provider_for(pool, out)
    result = await provider.add(pool, 2, "r1")
    assert [n.node_id for n in result.nodes] == ["a100-1", "a100-2"] and result.target_size == 2
    wait_for(lambda: len(list(out.glob("*.env.json"))) == 2)
    env = json.loads((out / "a100-1.env.json").read_text())
    assert env["XPUPOOL_NODE_ID"] == "a100-1"
    assert env["XPUPOOL_NODE_PROFILE"] == "8xA100-SXM4-80GB"
    assert env["XPUPOOL_BACKEND"] == "simulated"
    assert (env["XPUPOOL_CPU_MILLI"], env["XPUPOOL_MEMORY_MIB"]) == ("96000", "65536")
    assert env["XPUPOOL_SAMPLE_INTERVAL_S"] == "0.5"  # the pool's collector_env
    # Inherited: the broker URL. Not the parent pid: the collector's parent is the replica,
    # so it would stop at once (and a node must outlive the replica that started it).
    assert "XPUPOOL_PARENT_PID" not in env and env["XPUPOOL_NATS_URL"] == "nats://n:1"
    assert {n.state for n in await provider.list(pool)} == {NodeLifecycle.READY}


def test_the_default_launcher_runs_the_collector_module() -> None:
    assert CollectorLauncher().command == [sys.executable, "-m", COLLECTOR_MODULE]


async def test_a_replay_or_a_takeover_never_doubles_a_node(tmp_path: Path, out: Path) -> None:
    pool = sim_pool(tmp_path)
    first = provider_for(pool, out)
    await first.add(pool, 2, "r1")
    assert (await first.add(pool, 2, "r1")).already_applied
    second = provider_for(pool, out)  # another replica, its own launcher: same state
    replay = await second.add(pool, 2, "r1")
    assert replay.already_applied and [n.node_id for n in replay.nodes] == ["a100-1", "a100-2"]
    assert [n.state for n in await second.list(pool)] == [NodeLifecycle.READY] * 2
    with pytest.raises(ProviderError, match="2 nodes \\+ 2 exceed max_size 3"):
        await second.add(pool, 2, "r2")


async def test_a_takeover_resumes_a_half_done_add(tmp_path: Path, out: Path) -> None:
    pool = sim_pool(tmp_path)
    dying = provider_for(pool, out, cls=FailingSecondLaunch)
    with pytest.raises(ProviderError, match="cannot start the collector of a100-2"):
        await dying.add(pool, 2, "r1")
    assert [n.node_id for n in await dying.list(pool)] == ["a100-1"]
    heir = provider_for(pool, out)
    resumed = await heir.add(pool, 2, "r1")  # the same request: only the missing node starts
    assert not resumed.already_applied
    assert [n.node_id for n in await heir.list(pool)] == ["a100-1", "a100-2"]
    wait_for(lambda: len(list(out.glob("*.env.json"))) == 2)


async def test_remove_stops_the_processes_and_is_idempotent(tmp_path: Path, out: Path) -> None:
    pool = sim_pool(tmp_path)
    provider = provider_for(pool, out)
    await provider.add(pool, 2, "r1")
    pids = {
        json.loads(p.read_text())["node_id"]: json.loads(p.read_text())["pid"]
        for p in (tmp_path / "state" / "pools" / "a100").glob("*.json")
    }
    other = provider_for(pool, out)  # stops a process another replica started
    removed = await other.remove(pool, ["a100-1", "a100-9"], "r2")
    assert [(n.node_id, n.state) for n in removed.nodes] == [("a100-1", NodeLifecycle.REMOVING)]
    assert removed.target_size == 1
    wait_for(lambda: not provider.launcher.alive(pids["a100-1"]))
    assert provider.launcher.alive(pids["a100-2"])
    assert (await other.remove(pool, ["a100-1"], "r2")).already_applied
    assert [n.node_id for n in await provider.list(pool)] == ["a100-2"]
    await provider.remove(pool, ["a100-2"], "r3")
    assert not provider.launcher.alive(pids["a100-2"])
